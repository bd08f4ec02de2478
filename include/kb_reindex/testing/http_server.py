"""The HTTP server under our protocol test doubles (Ollama, Qdrant): threaded, and able to really drop
its clients, so a test can stop or restart a double while keep-alive connections are open."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class HttpError(Exception):
    """Raised inside a double's handlers to answer with that protocol's error shape and this status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ConnectionTrackingServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that tracks live connections so stop() can drop keep-alive clients."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # socketserver's default of 5 resets bursts of concurrent clients

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], fake: Any,
                 stopping: threading.Event) -> None:
        self.fake = fake
        self.stopping = stopping
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Shut down every open client socket; idle keep-alive threads would otherwise keep serving."""
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Stay quiet: clients that time out or vanish mid-answer are expected in these tests."""
