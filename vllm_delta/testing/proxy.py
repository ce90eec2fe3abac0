"""An HTTP proxy on 127.0.0.1 in front of a test S3 server: counts what clients read, and plays faults.

    with S3Server() as s3, S3Proxy(s3.endpoint_url) as proxy:
        store = DeltaStore(s3.uri("run1"), storage_options=proxy.storage_options(s3.storage_options))
        ...
        proxy.counts.bytes_out("GET", "data")   # bytes of data files the store's clients downloaded

Every request is forwarded as it came (method, path, query, headers, body), so S3's SigV4 signatures,
computed by the client for the proxy's host and port, verify upstream. Per request the proxy counts
the request and the bytes of the response body, keyed by method and *kind*: "list" for a listing,
else the folder of the object key under the store root ("data", "versions", "replicas", "bad",
"assets"; "" for an object at the root such as head.json). It can also refuse every write
(`read_only`: 403 AccessDenied, what S3 answers a client whose policy allows reads only), add a delay
to every request (`delay_s`: a far region), and go down and come back on the same port (`down`, `up`).
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import urllib.parse
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .ports import free_port

_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "expect"}
)
_WRITES = frozenset({"PUT", "POST", "DELETE"})
_ACCESS_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied (read-only proxy)</Message></Error>"
)


STORE_FOLDERS = frozenset({"data", "versions", "replicas", "bad", "assets", "mirror"})


def kind_of(path: str, query: str) -> str:
    """What a request reads or writes: "list" for a listing, the store folder of its key ("data",
    "versions", ...), or the object's own name for one outside them (e.g. "head.json")."""
    if "list-type" in query or "prefix=" in query:
        return "list"
    parts = [p for p in urllib.parse.unquote(path).split("/") if p]
    if len(parts) >= 2 and parts[-2] in STORE_FOLDERS:
        return parts[-2]
    return parts[-1] if parts else ""


class ProxyCounts:
    """Requests and response-body bytes by (method, kind); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._bytes: Counter[tuple[str, str]] = Counter()
        self._bytes_in: Counter[tuple[str, str]] = Counter()

    def add(self, method: str, kind: str, *, sent: int, received: int) -> None:
        with self._lock:
            self._requests[(method, kind)] += 1
            self._bytes[(method, kind)] += sent
            self._bytes_in[(method, kind)] += received

    def requests(self, method: str | None = None, kind: str | None = None) -> int:
        return self._total(self._requests, method, kind)

    def bytes_out(self, method: str | None = None, kind: str | None = None) -> int:
        """Bytes of response bodies the proxy sent to clients (what they read)."""
        return self._total(self._bytes, method, kind)

    def bytes_in(self, method: str | None = None, kind: str | None = None) -> int:
        """Bytes of request bodies clients sent (what they wrote)."""
        return self._total(self._bytes_in, method, kind)

    def _total(self, counter: Counter[tuple[str, str]], method: str | None, kind: str | None) -> int:
        with self._lock:
            return sum(
                n for (m, k), n in counter.items() if (method is None or m == method) and (kind is None or k == kind)
            )

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                "requests": {f"{m} {k}": n for (m, k), n in sorted(self._requests.items())},
                "bytes_out": {f"{m} {k}": n for (m, k), n in sorted(self._bytes.items())},
                "bytes_in": {f"{m} {k}": n for (m, k), n in sorted(self._bytes_in.items())},
            }

    def reset(self) -> None:
        with self._lock:
            self._requests.clear()
            self._bytes.clear()
            self._bytes_in.clear()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall
    server: _ProxyServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):  # a client gone, or the proxy cut it (`down`)
            super().handle()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._forward()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET  # noqa: N815

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self) -> None:
        proxy = self.server.proxy
        body = self._body()
        path, _, query = self.path.partition("?")
        kind = kind_of(path, query)
        if proxy.delay_s:
            time.sleep(proxy.delay_s)
        if proxy.read_only and self.command in _WRITES:
            # Counted before the answer: a client that got its 403 may read the counts at once.
            proxy.counts.add(self.command, kind, sent=0, received=len(body))
            self._answer(403, _ACCESS_DENIED, {"Content-Type": "application/xml"})
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body or self.command in _WRITES:
            headers["Content-Length"] = str(len(body))
        try:
            status, reason, resp_headers, data = proxy.upstream_call(self.command, self.path, body, headers)
        except (OSError, http.client.HTTPException):  # down, or a response cut short
            self.close_connection = True
            self._answer(502, b"upstream unreachable", {"Content-Type": "text/plain"})
            return
        sent = 0 if self.command == "HEAD" else len(data)
        proxy.counts.add(self.command, kind, sent=sent, received=len(body))
        self.send_response(status, reason)
        for k, v in resp_headers:
            if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length":
                self.send_header(k, v)
        length = resp_headers_length(resp_headers, len(data))
        self.send_header("Content-Length", str(length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _answer(self, status: int, data: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


def resp_headers_length(headers: list[tuple[str, str]], body: int) -> int:
    """A HEAD's Content-Length is the object's size (no body follows); otherwise the body's."""
    for k, v in headers:
        if k.lower() == "content-length" and body == 0:
            return int(v)
    return body


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], proxy: S3Proxy):
        self.proxy = proxy
        self.open_sockets: set[socket.socket] = set()  # clients' keep-alive connections, cut by `down`
        self._sockets_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._sockets_lock:
            self.open_sockets.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._sockets_lock:
                self.open_sockets.discard(request)

    def cut(self) -> None:
        """Close every client connection (a server that went down does not answer on old ones either)."""
        with self._sockets_lock:
            sockets = list(self.open_sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class S3Proxy:
    """The proxy: `endpoint_url` for clients, `counts` of what went through. Context manager."""

    def __init__(self, upstream_url: str, *, read_only: bool = False, delay_s: float = 0.0):
        parsed = urllib.parse.urlsplit(upstream_url)
        if parsed.scheme != "http" or parsed.hostname is None or parsed.port is None:
            raise ValueError(f"an http://host:port upstream, not {upstream_url!r}")
        self.upstream = (parsed.hostname, parsed.port)
        self.read_only = read_only
        self.delay_s = delay_s
        self.counts = ProxyCounts()
        self.port: int | None = None
        self._server: _ProxyServer | None = None
        self._thread: threading.Thread | None = None
        self._local = threading.local()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """`options` (an S3 server's storage options) with the endpoint replaced by this proxy's."""
        out = dict(options)
        out["client_kwargs"] = {**dict(options.get("client_kwargs") or {}), "endpoint_url": self.endpoint_url}
        return out

    def upstream_call(
        self, method: str, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """One request to the upstream server on this thread's keep-alive connection (one retry on a
        connection the upstream closed)."""
        for attempt in range(2):
            conn = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(*self.upstream, timeout=120)
            try:
                conn.request(method, path, body=body or None, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                return resp.status, resp.reason, resp.getheaders(), data
            except (http.client.HTTPException, OSError):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def start(self) -> S3Proxy:
        return self._start(None)

    def _start(self, port: int | None) -> S3Proxy:
        if self._server is not None:
            return self
        last: OSError | None = None
        for _ in range(40 if port is not None else 3):
            try:
                self._server = _ProxyServer(("127.0.0.1", port or free_port()), self)
                break
            except OSError as exc:  # the port is still held briefly after `down`, or was taken
                last = exc
                time.sleep(0.25)
        if self._server is None:
            raise RuntimeError(f"the proxy could not listen: {last}")
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-proxy", daemon=True)
        self._thread.start()
        return self

    def down(self) -> None:
        """Stop listening (clients get connection refused); the port is kept for `up`."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server.cut()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def up(self) -> S3Proxy:
        return self._start(self.port)

    def stop(self) -> None:
        self.down()

    def __enter__(self) -> S3Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["STORE_FOLDERS", "ProxyCounts", "S3Proxy", "kind_of"]
