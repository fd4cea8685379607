"""A real S3-protocol server on loopback, and a fault-injecting proxy in front of it.

:class:`LoopbackS3` starts moto's server (``moto[server]``, the test extra) on ``127.0.0.1``
with one bucket; :meth:`LoopbackS3.client_environment` is what a process needs to reach it
the standard way (``AWS_ENDPOINT_URL_S3`` and credentials in the environment, as botocore reads
them), so the connector and the CLI reach it exactly as they would reach AWS S3 or MinIO.

:class:`FaultProxy` is an HTTP proxy on ``127.0.0.1`` that forwards every request to such a
server and, for the requests a :class:`Fault` rule matches, answers otherwise: late
(``delay_s``), with an S3 error (``status`` and ``code``: 500 ``InternalError``, 503
``SlowDown``, 403 ``AccessDenied``), with a body cut short of its ``Content-Length``
(``truncate``), or by closing the connection (``drop``). :meth:`FaultProxy.stop` closes its
port: the remote is down (connection refused). Nothing here leaves loopback.

The soak (``benchmarks/remote_soak.py``), the remote tier's benchmark
(``benchmarks/remote_tier.py``) and the tests (``tests/engines/vllm/test_remote_*.py``) use
it.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: Response headers not forwarded as they came (the proxy sets its own length).
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "server", "date"}
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LoopbackS3:
    """moto's S3 server on ``127.0.0.1`` with the bucket ``bucket``."""

    def __init__(self, bucket: str = "kvsnap-remote") -> None:
        from moto.server import ThreadedMotoServer

        self.bucket = bucket
        self.port = free_port()
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.filesystem().call_s3("create_bucket", Bucket=bucket)

    def client_environment(self, endpoint: str | None = None) -> dict[str, str]:
        """Environment variables that point botocore (s3fs) at ``endpoint`` (default: this
        server) with test credentials, the way a real deployment configures it."""
        return {
            "AWS_ENDPOINT_URL_S3": endpoint or self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def storage_options(self, endpoint: str | None = None) -> dict[str, Any]:
        """The s3fs options that reach ``endpoint`` (default: this server) directly."""
        return {
            "endpoint_url": endpoint or self.endpoint,
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"},
            "skip_instance_cache": True,
        }

    def filesystem(self) -> Any:
        """An s3fs filesystem on this server (no proxy)."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options())

    def stop(self) -> None:
        """Stop the server (its data is gone with it)."""
        self._server.stop()


@dataclass
class Fault:
    """How the proxy answers the requests it matches: ``method`` (``None``: any) and a
    ``path`` regular expression; ``times`` matches left (``None``: every one)."""

    path: str = ".*"
    method: str | None = None
    delay_s: float = 0.0
    status: int | None = None
    code: str = "InternalError"
    truncate: bool = False
    drop: bool = False
    times: int | None = None

    def matches(self, method: str, path: str) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.method is not None and method != self.method:
            return False
        return re.search(self.path, path) is not None


class FaultProxy:
    """An HTTP proxy on ``127.0.0.1`` in front of ``target`` (``host:port``) that applies the
    first matching rule of :attr:`faults` to each request. Counts requests by method."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.faults: list[Fault] = []
        self.requests: dict[str, int] = {}
        #: Requests the proxy has answered (forwarded and responded, or failed as a rule said).
        self.answered = 0
        self.bytes_sent = 0
        self._lock = threading.Lock()
        #: Open client connections: closed by :meth:`stop` (a keep-alive connection would
        #: otherwise outlive the port).
        self._connections: set[socket.socket] = set()
        self._stopped = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                return

            def setup(self) -> None:
                super().setup()
                with proxy._lock:
                    proxy._connections.add(self.connection)

            def finish(self) -> None:
                with proxy._lock:
                    proxy._connections.discard(self.connection)
                super().finish()

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        self._handler = Handler
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._serve()

    def _serve(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def set_faults(self, *faults: Fault) -> None:
        """Replace the rules (none: every request forwarded as it is)."""
        with self._lock:
            self.faults = list(faults)

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.requests[method] = self.requests.get(method, 0) + 1
            for fault in self.faults:
                if fault.matches(method, path):
                    if fault.times is not None:
                        fault.times -= 1
                    return fault
        return None

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        try:
            self._respond(handler)
        finally:
            with self._lock:
                self.answered += 1

    def _respond(self, handler: BaseHTTPRequestHandler) -> None:
        body = _request_body(handler)
        fault = self._fault_for(handler.command, handler.path)
        if fault is not None and fault.delay_s:
            time.sleep(fault.delay_s)
        if self._stopped or (fault is not None and fault.drop):
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault is not None and fault.status is not None:
            _error_response(handler, fault.status, fault.code)
            return
        status, headers, payload = self._forward(handler, body)
        handler.send_response(status)
        length = str(len(payload))
        for name, value in headers:
            if name.lower() == "content-length" and handler.command == "HEAD":
                length = value  # the object's, not this empty body's
            elif name.lower() not in _HOP_HEADERS:
                handler.send_header(name, value)
        handler.send_header("Content-Length", length)
        handler.end_headers()
        if handler.command == "HEAD":
            return
        if fault is not None and fault.truncate and len(payload) > 1:
            handler.wfile.write(payload[: len(payload) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return
        handler.wfile.write(payload)
        with self._lock:
            self.bytes_sent += len(payload)

    def _forward(
        self, handler: BaseHTTPRequestHandler, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", self.target_port, timeout=60)
        try:
            headers = {
                name: value
                for name, value in handler.headers.items()
                if name.lower() not in ("transfer-encoding", "connection")
            }
            headers["Content-Length"] = str(len(body))
            connection.request(handler.command, handler.path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read()
            return response.status, response.getheaders(), payload
        finally:
            connection.close()

    def stop(self) -> None:
        """Close the proxy's port and every open connection: from now on the remote is down
        (connection refused)."""
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def start(self) -> None:
        """Listen again on the same port after :meth:`stop`: the remote is back."""
        self._stopped = False
        self._serve()


def _request_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request's body, whether sized or chunked."""
    length = handler.headers.get("Content-Length")
    if length is not None:
        return handler.rfile.read(int(length))
    if handler.headers.get("Transfer-Encoding", "").lower() != "chunked":
        return b""
    parts = []
    while True:
        size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            handler.rfile.readline()
            return b"".join(parts)
        parts.append(handler.rfile.read(size))
        handler.rfile.readline()


def _error_response(handler: BaseHTTPRequestHandler, status: int, code: str) -> None:
    """An S3 error document with ``status`` and ``code``."""
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        f"<Error><Code>{code}</Code><Message>injected by the test proxy</Message></Error>"
    ).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/xml")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    if handler.command != "HEAD":
        handler.wfile.write(body)
