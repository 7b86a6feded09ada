"""``python -m benchmarks``; the guard keeps forkserver children from re-running it."""

from benchmarks.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
