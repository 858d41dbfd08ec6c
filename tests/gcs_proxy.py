"""An HTTP proxy in front of a GCS emulator that misbehaves on purpose: injected faults and hostile names.

Why HTTP and not the TCP `Gate` (tests/gcs_emulator.py): the faults real GCS gives are answers, not
only dead connections: a 503 or 429 burst, a slow answer, a 503 after the write was done (the
client retries a request whose first attempt succeeded), a 403. A proxy that reads each request
and decides its answer gives all three clients (google-cloud-storage, gcsfs, TensorStore) exactly
those, on the production code path, pointed at it by the same environment as the emulator
(`FaultProxy.env`).

It also serves names the emulator cannot store (it refuses `..` in a name; real GCS allows it):
`rename(stored, shown)` lists and serves the object stored as `stored` under the name `shown`.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import quote, unquote

from gcs_emulator import emulator_env

#: Headers that belong to one hop of a connection, never forwarded.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authorization", "proxy-authenticate", "content-length"}
_REASONS = {403: "forbidden", 404: "notFound", 429: "rateLimitExceeded", 500: "backendError", 503: "backendError"}


@dataclasses.dataclass
class Fault:
    """What the proxy does to the requests `matches` selects, `times` of them (None: every one)."""

    matches: Callable[[str, str], bool]
    """(method, URL path with query) -> whether this fault applies."""
    status: int | None = None
    """Answer with this status: instead of forwarding, or (with `after`) after forwarding."""
    after: bool = False
    """Forward first (the emulator does the work), then answer `status`: the client sees a failure."""
    delay_s: float = 0.0
    """Wait this long before handling (a slow answer)."""
    drop: bool = False
    """Close the connection without an answer (a reset)."""
    times: int | None = 1
    hits: int = 0


class FaultProxy:
    """A threaded HTTP proxy on loopback forwarding to `target_port`, applying `faults` in order."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.faults: list[Fault] = []
        self.renames: dict[str, str] = {}  # shown -> stored
        self.log: list[tuple[str, str, int]] = []  # (method, path, status the client got)
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self.port = int(self._server.server_address[1])
        threading.Thread(target=self._server.serve_forever, name=f"gcs-proxy-{self.port}", daemon=True).start()

    @property
    def env(self) -> dict[str, str]:
        """Environment that points every GCS client at the emulator through this proxy."""
        return emulator_env(self.port)

    def add(self, fault: Fault, *, first: bool = False) -> Fault:
        """Apply `fault` from now on, after the faults already there (or, `first`, before them)."""
        with self._lock:
            self.faults.insert(0 if first else len(self.faults), fault)
        return fault

    def clear(self) -> None:
        """No faults from now on."""
        with self._lock:
            self.faults.clear()

    def rename(self, stored: str, shown: str) -> None:
        """List and serve the object stored as `stored` under the name `shown` (which the emulator may refuse)."""
        self.renames[shown] = stored

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if (fault.times is None or fault.hits < fault.times) and fault.matches(method, path):
                    fault.hits += 1
                    return fault
        return None

    def _inbound(self, path: str) -> str:
        """A request path with every shown name (percent-encoded after `/o/`) replaced by its stored one."""
        head, sep, rest = path.partition("/o/")
        if not sep or not self.renames:
            return path
        name, q, query = rest.partition("?")
        stored = self.renames.get(unquote(name))
        return head + sep + (quote(stored, safe="") if stored else name) + q + query

    def _outbound(self, body: bytes) -> bytes:
        """A JSON answer with every stored name replaced by its shown one (names, ids and links)."""
        for shown, stored in self.renames.items():
            body = body.replace(json.dumps(stored)[1:-1].encode(), json.dumps(shown)[1:-1].encode())
            body = body.replace(quote(stored, safe="").encode(), quote(shown, safe="").encode())
        return body


def gcs_error(status: int) -> bytes:
    """An error body as GCS writes it."""
    message = http.client.responses.get(status, "error") + " (injected by the test proxy)"
    return json.dumps({"error": {"code": status, "message": message, "errors": [{"reason": _REASONS.get(status, "invalid"), "message": message}]}}).encode()


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        """A client that hung up (a timeout, a reset it chose) is what these tests make happen: no traceback."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        return

    def do_GET(self) -> None:
        self._handle()

    do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        body = self._body()
        fault = proxy._fault_for(self.command, self.path)
        if fault is not None and fault.delay_s:
            time.sleep(fault.delay_s)
        if fault is not None and fault.drop:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            proxy.log.append((self.command, self.path, 0))
            return
        if fault is not None and fault.status is not None and not fault.after:
            self._answer(fault.status, {"Content-Type": "application/json"}, gcs_error(fault.status))
            return
        status, headers, data = self._forward(proxy, body)
        if fault is not None and fault.status is not None:  # after: the work is done, the client is told otherwise
            self._answer(fault.status, {"Content-Type": "application/json"}, gcs_error(fault.status))
            return
        if proxy.renames and any(k.lower() == "content-type" and "json" in v for k, v in headers.items()):
            data = proxy._outbound(data)
        self._answer(status, headers, data)

    def _forward(self, proxy: FaultProxy, body: bytes) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.target_port, timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            conn.request(self.command, proxy._inbound(self.path), body=body if body or self.command in ("POST", "PUT", "PATCH") else None, headers=headers)
            response = conn.getresponse()
            data = response.read()
            return response.status, {k: v for k, v in response.getheaders() if k.lower() not in _HOP}, data
        finally:
            conn.close()

    def _answer(self, status: int, headers: dict[str, str], data: bytes) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        proxy.log.append((self.command, self.path, status))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
