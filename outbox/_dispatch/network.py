"""How long a dispatcher connection may wait on the network: the defaults every connection
it opens gets, under the connection string's own parameters.

    connect_timeout     seconds to open one connection to one host (libpq applies it to
                        each host of a multi-host DSN in turn)
    keepalives_*        an idle connection (or one waiting for a statement's answer) whose
                        peer is gone is noticed after idle + interval * count seconds
    tcp_user_timeout    sent data unacknowledged that long (milliseconds): the connection
                        is given up, instead of the kernel's retransmissions (~15 minutes)

A parameter the connection string sets (``connect_timeout=3``, ``keepalives_idle=30``),
or ``PGCONNECT_TIMEOUT`` in the environment, wins: these are only what is used where it
says nothing. psycopg lets keyword arguments override the string, so only the parameters
the string does not name are passed. They apply to TCP connections; libpq ignores them on
a Unix socket.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

__all__ = ["NETWORK_DEFAULTS", "network_options"]

# A peer that stops answering is given up within 8 seconds, so noticed within 10: 4 s
# idle, then 2 probes 2 s apart; data sent and not acknowledged for 8 s.
NETWORK_DEFAULTS: Mapping[str, int] = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 4,
    "keepalives_interval": 2,
    "keepalives_count": 2,
    "tcp_user_timeout": 8000,
}

# libpq's environment variables for these parameters: set, they count as given.
_ENVIRONMENT = {"connect_timeout": "PGCONNECT_TIMEOUT"}


def network_options(conninfo: str, **defaults: int) -> dict[str, Any]:
    """The network parameters to pass with ``conninfo``: ``NETWORK_DEFAULTS`` (updated
    by ``defaults``) less those the string or the environment sets itself."""
    wanted = {**NETWORK_DEFAULTS, **defaults}
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error:
        given = {}  # the connect says what is wrong with it, password left out
    return {name: value for name, value in wanted.items()
            if name not in given and not os.environ.get(_ENVIRONMENT.get(name, ""), "")}
