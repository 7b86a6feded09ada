"""One dispatcher process of the shop: runs until SIGTERM, then prints its counters.

``python -m examples.shop.worker`` (the demo's way: counters as JSON on stdout), or
``outbox run examples.shop.worker:dispatcher``.
"""

from __future__ import annotations

import json
import logging
import sys

from examples.shop.app import dispatcher

__all__ = ["dispatcher", "main"]


def main() -> None:
    """Run the shop's dispatcher; print its DispatchStats as JSON on stdout at exit."""
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    stats = dispatcher().run()
    print(json.dumps(stats.as_dict()), flush=True)


if __name__ == "__main__":
    main()
