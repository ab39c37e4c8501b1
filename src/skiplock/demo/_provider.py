"""A fake email provider on 127.0.0.1 that counts every send, so duplicates cannot hide.

It behaves like the HTTP APIs of real providers (Stripe's and Postmark's idempotency
semantics): ``POST /emails`` with a JSON body sends one email; with an
``Idempotency-Key`` header, a repeat of that key sends nothing and answers with the
first response again, marked ``Idempotent-Replayed: true``; the same key with a
different body is refused with 422.  The counters are what the demo reports: emails
accepted per invoice, and repeats suppressed by their key.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

__all__ = ["FakeEmailProvider", "ProviderStats"]

# Header names as Stripe spells them; http.server looks headers up case-insensitively.
KEY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"
WORKER_HEADER = "X-Worker"


@dataclass
class ProviderStats:
    """A copy of the provider's counters at one moment.

    ``per_worker`` counts requests by the ``X-Worker`` header; ``senders`` lists, per
    invoice, the workers whose sends were accepted (the provider's log of who sent).
    """

    requests: int = 0
    accepted: int = 0
    suppressed: int = 0
    rejected: int = 0
    per_invoice: Counter[int] = field(default_factory=Counter)
    per_worker: Counter[str] = field(default_factory=Counter)
    senders: dict[int, list[str]] = field(default_factory=dict)

    @property
    def duplicate_emails(self) -> int:
        """Emails accepted beyond the first for their invoice: what customers saw twice."""
        return sum(n - 1 for n in self.per_invoice.values() if n > 1)

    @property
    def invoices_emailed_twice(self) -> int:
        """Invoices whose customer received more than one email."""
        return sum(1 for n in self.per_invoice.values() if n > 1)


@dataclass
class _Sent:
    """The first response to an idempotency key, replayed to every repeat."""

    body_digest: str
    status: int
    response: bytes
    done: threading.Event = field(default_factory=threading.Event)


class FakeEmailProvider:
    """An HTTP email API on 127.0.0.1 (a free port) that records every request.

    Parameters
    ----------
    latency
        ``(low, high)`` seconds each accepted send takes, drawn uniformly: a real API
        call is not free, and a send that takes time is where a crashed worker leaves
        a job sent but not marked done.
    port
        0 for a free port; see :attr:`url` once started.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, *, latency: tuple[float, float] = (0.001, 0.005), port: int = 0) -> None:
        low, high = latency
        if low < 0 or high < low:
            raise ValueError("latency must be (low, high) with 0 <= low <= high")
        self.latency = (float(low), float(high))
        self._lock = threading.Lock()
        self._keys: dict[str, _Sent] = {}
        self._stats = ProviderStats()
        self._next_id = 0
        self._server = _Server(("127.0.0.1", port), _RequestHandler)
        self._server.provider = self
        self._thread: threading.Thread | None = None

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeEmailProvider:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.1},
                name="skiplock-demo-provider",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FakeEmailProvider:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- counters ------------------------------------------------------------------------

    def stats(self) -> ProviderStats:
        with self._lock:
            s = self._stats
            return ProviderStats(
                s.requests,
                s.accepted,
                s.suppressed,
                s.rejected,
                Counter(s.per_invoice),
                Counter(s.per_worker),
                {invoice: list(who) for invoice, who in s.senders.items()},
            )

    # -- the API -------------------------------------------------------------------------

    def handle_send(
        self, body: bytes, key: str | None, worker: str | None
    ) -> tuple[int, bytes, bool]:
        """One ``POST /emails``: returns (status, response body, replayed)."""
        with self._lock:
            self._stats.requests += 1
            if worker:
                self._stats.per_worker[worker] += 1
        try:
            doc = json.loads(body)
            invoice_id = int(doc["invoice_id"])
            to = str(doc["to"])
        except (ValueError, KeyError, TypeError):
            return self._reject(400, "body must be JSON with invoice_id and to")
        if key is None:
            status, response = self._send(invoice_id, to, worker)
            return status, response, False
        digest = _digest(doc)
        with self._lock:
            first = self._keys.get(key)
            if first is None:
                first = self._keys[key] = _Sent(digest, 0, b"")
                owner = True
            else:
                owner = False
        if owner:
            try:
                first.status, first.response = self._send(invoice_id, to, worker)
            finally:
                first.done.set()
            return first.status, first.response, False
        # A repeat that arrives while the first send is still in flight waits for it (Stripe
        # answers 409 there instead; waiting keeps the demo's handlers free of a retry path
        # that would only blur the counts).
        first.done.wait()
        if first.body_digest != digest:
            return self._reject(422, f"idempotency key {key!r} was used with a different body")
        with self._lock:
            self._stats.suppressed += 1
        return first.status, first.response, True

    def _send(self, invoice_id: int, to: str, worker: str | None) -> tuple[int, bytes]:
        low, high = self.latency
        if high > 0:
            time.sleep(random.uniform(low, high))  # the provider's own work, simulated
        with self._lock:
            self._next_id += 1
            message_id = f"msg_{self._next_id:08d}"
            self._stats.accepted += 1
            self._stats.per_invoice[invoice_id] += 1
            self._stats.senders.setdefault(invoice_id, []).append(worker or "?")
        body = {"id": message_id, "status": "sent", "invoice_id": invoice_id, "to": to}
        return 200, json.dumps(body).encode()

    def _reject(self, status: int, message: str) -> tuple[int, bytes, bool]:
        with self._lock:
            self._stats.rejected += 1
        return status, json.dumps({"error": message}).encode(), False


def _digest(doc: Any) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # Every worker thread opens its keep-alive connection at once when the demo starts;
    # the default backlog of 5 would drop SYNs and stall those sends by a full second.
    request_queue_size = 256
    provider: FakeEmailProvider

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A SIGKILLed worker resets its keep-alive connection; that is the demo working.
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class _RequestHandler(BaseHTTPRequestHandler):
    # HTTP/1.1 keeps connections alive: one TCP handshake per worker thread, not per send.
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes; with Nagle on, the body waits for the
    # client's delayed ACK of the headers, 40 ms per send on Linux.
    disable_nagle_algorithm = True
    server: _Server

    def do_POST(self) -> None:
        if self.path != "/emails":
            self._reply(404, b'{"error": "not found"}')
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        status, response, replayed = self.server.provider.handle_send(
            body, self.headers.get(KEY_HEADER), self.headers.get(WORKER_HEADER)
        )
        self._reply(status, response, {REPLAYED_HEADER: "true"} if replayed else None)

    def do_GET(self) -> None:
        if self.path != "/stats":
            self._reply(404, b'{"error": "not found"}')
            return
        s = self.server.provider.stats()
        doc = {
            "requests": s.requests,
            "accepted": s.accepted,
            "suppressed": s.suppressed,
            "rejected": s.rejected,
            "duplicate_emails": s.duplicate_emails,
        }
        self._reply(200, json.dumps(doc).encode())

    def _reply(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # thousands of sends per run; the counters are the log
