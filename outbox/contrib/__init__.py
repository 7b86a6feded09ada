"""Integrations with application frameworks, each an optional extra.

``outbox.contrib.sqlalchemy`` (``outbox-pg[sqlalchemy]``) and ``outbox.contrib.django``
(``outbox-pg[django]``) open the outbox block through the ORM's own transaction, so the jobs
commit if and only if the ORM's transaction commits. ``import outbox`` imports neither.
"""
