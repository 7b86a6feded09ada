"""A tiny Django app for the tests of ``outbox.contrib.django``: orders and one view."""
