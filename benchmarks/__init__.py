"""Benchmarks of outbox on PostgreSQL: ``make bench`` or ``python -m benchmarks``.

Six sections (drain, enqueue, wake, latency, bloat, memory), each figure the median of
several runs with its min..max spread, printed beside a baseline measured in the same
invocation, with the ratio and the performance target. Everything measured, raw runs
included, goes to ``benchmarks/results/<timestamp>.json``. See ``benchmarks/README.md``.

Never part of ``make test``; every loop here is bounded in count and time, and every
socket is a unix socket or 127.0.0.1.
"""
