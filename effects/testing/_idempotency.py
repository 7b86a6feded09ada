"""A provider's memory of idempotency keys: in flight, or answered and saved for a while."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum

from ._http import Reply

__all__ = ["Begun", "IdempotencyStore", "KeyState"]


class KeyState(Enum):
    """What a provider finds when a request with a key arrives."""

    NEW = "new"  # first use (or the saved answer expired): perform it
    REPLAY = "replay"  # same request answered before: send the saved answer again
    MISMATCH = "mismatch"  # the key was used for a different request
    IN_FLIGHT = "in_flight"  # the first request with the key is still being performed


@dataclass(frozen=True)
class Begun:
    """The state found, and the saved answer when it is a replay."""

    state: KeyState
    reply: Reply | None = None


@dataclass
class _Entry:
    fingerprint: str
    reply: Reply | None  # None while in flight
    saved_at: float


class IdempotencyStore:
    """Keys seen by one fake, thread-safe.

    A key is taken by the first request (in flight) and either answered (the reply is
    saved for ``retention`` seconds from then) or abandoned (forgotten, as providers do
    for requests that failed before they executed).
    """

    def __init__(self, retention: float) -> None:
        if retention <= 0:
            raise ValueError("retention must be positive")
        self.retention = retention
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def begin(self, key: str, fingerprint: str, now: float) -> Begun:
        """Take ``key`` for a request identified by ``fingerprint``, or say why not."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and self._expired(entry, now):
                del self._entries[key]
                entry = None
            if entry is None:
                self._entries[key] = _Entry(fingerprint, None, now)
                return Begun(KeyState.NEW)
            if entry.reply is None:
                return Begun(KeyState.IN_FLIGHT)
            if entry.fingerprint != fingerprint:
                return Begun(KeyState.MISMATCH)
            return Begun(KeyState.REPLAY, entry.reply)

    def save(self, key: str, reply: Reply, now: float) -> None:
        """Remember ``reply`` as the answer to ``key`` from ``now`` on."""
        with self._lock:
            entry = self._entries[key]
            entry.reply = reply
            entry.saved_at = now

    def abandon(self, key: str) -> None:
        """Forget an in-flight ``key``: its request did not execute."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.reply is None:
                del self._entries[key]

    def clear(self) -> None:
        """Forget every key."""
        with self._lock:
            self._entries.clear()

    def _expired(self, entry: _Entry, now: float) -> bool:
        return entry.reply is not None and now - entry.saved_at >= self.retention
