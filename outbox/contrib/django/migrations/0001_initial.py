"""The outbox schema, created by outbox's own SQL files (``migrations/*.sql``).

One Django migration stands for all of them: it applies every SQL migration the installed
outbox knows, recorded in ``<schema>.schema_migrations`` as ``outbox migrate`` records
them, and later SQL migrations are applied by the app's ``post_migrate`` hook, so no
Django migration is written per SQL file. Reversing it forgets Django's record and keeps
the tables (outbox migrations are forward-only).
"""

from django.db import migrations

from outbox.contrib.django._schema import run_sql_migrations


class Migration(migrations.Migration):
    initial = True
    operations = [  # noqa: RUF012 (Django's own declaration style)
        migrations.RunPython(run_sql_migrations, migrations.RunPython.noop, elidable=False),
    ]
