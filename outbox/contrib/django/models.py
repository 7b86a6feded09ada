"""No models: the outbox tables belong to the ``migrations/*.sql`` files.

The module exists because Django sends ``post_migrate`` (which ``flush`` also sends) only
to apps that have one; the app listens to it to upgrade and to flush the outbox tables.
"""
