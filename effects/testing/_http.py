"""A small real HTTP server on 127.0.0.1 for the fakes: one thread per connection.

Connections are HTTP/1.0 (closed after each answer), so no keep-alive socket outlives a
request, and closing the server joins every handler thread: nothing leaks into the next
test.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

__all__ = ["LocalServer", "Reply", "Request"]

log = logging.getLogger("effects.testing")


@dataclass(frozen=True)
class Request:
    """One request as the fake received it; header names are lower-case."""

    method: str
    path: str
    query: str
    headers: Mapping[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        """The value of header ``name`` (any case), or None."""
        return self.headers.get(name.lower())


@dataclass(frozen=True)
class Reply:
    """One answer: status, body and extra headers."""

    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = field(default=())

    @classmethod
    def json(
        cls, status: int, document: Any, headers: tuple[tuple[str, str], ...] = ()
    ) -> Reply:
        """A JSON answer."""
        content = (("Content-Type", "application/json"), *headers)
        return cls(status, json.dumps(document).encode(), content)

    def with_header(self, name: str, value: str) -> Reply:
        """This answer with one more header."""
        return Reply(self.status, self.body, (*self.headers, (name, value)))


# Answer a request, or return None to close the connection without answering.
Answer = Callable[[Request], Reply | None]


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"
    timeout = 10  # seconds a silent client may hold a handler thread

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        headers = {name.lower(): value for name, value in self.headers.items()}
        request = Request(self.command, parts.path, parts.query, headers, body)
        reply = self.server.answer(request)
        if reply is None:
            self.close_connection = True
            return
        self._write(reply)

    def _write(self, reply: Reply) -> None:
        try:
            self.send_response(reply.status)
            for name, value in reply.headers:
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(reply.body)
        except OSError:
            # The client gave up (e.g. a stalled answer past its timeout): nobody to tell.
            log.debug("client left before its answer was written", exc_info=True)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = False  # so server_close() joins every handler thread
    block_on_close = True
    # A dispatcher opens one connection per request in flight (up to its concurrency, or
    # more across processes): the default backlog of 5 would reset some of them.
    request_queue_size = 128

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would resolve the host name; a loopback fake needs not.
        socketserver.TCPServer.server_bind(self)
        self.server_name = "127.0.0.1"
        self.server_port = self.socket.getsockname()[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def disconnect_all(self) -> None:
        """Cut every open connection, so no handler waits on a silent client."""
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):  # already closed by its handler
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("fake provider: error while serving %s", client_address, exc_info=True)


class LocalServer:
    """A started HTTP server on an ephemeral port of 127.0.0.1, answering with ``answer``."""

    def __init__(self, answer: Answer, *, name: str) -> None:
        self._server = _Server(answer)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.02},
            name=f"{name}:{self.port}",
            daemon=True,
        )
        self._thread.start()

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return int(self._server.server_address[1])

    def close(self) -> None:
        """Stop accepting, cut open connections, and join every thread of the server."""
        self._server.shutdown()
        self._server.disconnect_all()
        self._server.server_close()
        self._thread.join()
