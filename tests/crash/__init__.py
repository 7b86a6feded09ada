"""Crash, concurrency and failure-window tests: real processes, kill -9, real PostgreSQL.

Each failure window (a moment of a job's life where a crash, a stall or a provider fault
must lose nothing and do nothing twice) has at least one test here. Workers are
subprocesses (``python -m tests.crash.worker``); the provider is a pair of tables
written from the effect's own connections (see ``provider``).
"""
