"""Crash, concurrency and failure-window tests: real processes, kill -9, real PostgreSQL.

Each failure window of DESIGN.md ("Failure windows the tests must cover") has at least one
test here. Workers are subprocesses (``python -m tests.crash.worker``); the provider is a
pair of tables written from the effect's own connections (see ``provider``).
"""
