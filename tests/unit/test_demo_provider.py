"""The fake email provider keeps real providers' idempotency promise, or the demo proves nothing."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from skiplock.demo import FakeEmailProvider


@pytest.fixture
def provider() -> Iterator[FakeEmailProvider]:
    with FakeEmailProvider(latency=(0.0, 0.0)) as p:
        yield p


def post(
    p: FakeEmailProvider,
    body: Any,
    key: str | None = None,
    worker: str | None = "w0",
    path: str = "/emails",
) -> tuple[int, dict[str, Any], bool]:
    host, port = p.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if worker is not None:
        headers["X-Worker"] = worker
    try:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, raw, headers)
        resp = conn.getresponse()
        doc = json.loads(resp.read())
        return resp.status, doc, resp.getheader("Idempotent-Replayed") == "true"
    finally:
        conn.close()


def email(invoice: int, to: str = "a@example.com") -> dict[str, Any]:
    return {"invoice_id": invoice, "to": to, "subject": f"Invoice #{invoice}"}


def test_listens_on_loopback_on_a_free_port(provider: FakeEmailProvider) -> None:
    assert provider.url.startswith("http://127.0.0.1:")
    with FakeEmailProvider() as other:
        assert other.url != provider.url


def test_without_a_key_every_request_is_an_email(provider: FakeEmailProvider) -> None:
    first = post(provider, email(1))
    second = post(provider, email(1))
    assert first[0] == second[0] == 200
    assert first[1]["id"] != second[1]["id"]
    assert not first[2] and not second[2]
    s = provider.stats()
    assert (s.requests, s.accepted, s.suppressed) == (2, 2, 0)
    assert s.per_invoice[1] == 2
    assert s.duplicate_emails == 1
    assert s.invoices_emailed_twice == 1
    assert s.senders[1] == ["w0", "w0"]


def test_a_repeated_key_replays_the_first_response_and_sends_nothing(
    provider: FakeEmailProvider,
) -> None:
    status, first, replayed = post(provider, email(7), key="skiplock:emails:7", worker="w1")
    assert (status, replayed) == (200, False)
    status, again, replayed = post(provider, email(7), key="skiplock:emails:7", worker="w2")
    assert (status, replayed) == (200, True)
    assert again == first  # the same message id: one email, described twice
    s = provider.stats()
    assert (s.requests, s.accepted, s.suppressed, s.duplicate_emails) == (2, 1, 1, 0)
    assert s.senders[7] == ["w1"]
    assert s.per_worker == {"w1": 1, "w2": 1}


def test_keys_are_independent(provider: FakeEmailProvider) -> None:
    post(provider, email(1), key="k1")
    post(provider, email(2), key="k2")
    post(provider, email(1), key="k3")  # a new key is a new email, even for the same invoice
    s = provider.stats()
    assert (s.accepted, s.suppressed) == (3, 0)
    assert s.per_invoice == {1: 2, 2: 1}


def test_a_key_reused_with_another_body_is_refused(provider: FakeEmailProvider) -> None:
    assert post(provider, email(1), key="k")[0] == 200
    status, doc, replayed = post(provider, email(2), key="k")
    assert (status, replayed) == (422, False)
    assert "different body" in doc["error"]
    s = provider.stats()
    assert (s.accepted, s.suppressed, s.rejected) == (1, 0, 1)


def test_concurrent_repeats_of_a_key_send_once() -> None:
    # A send that takes 50 ms: every repeat arrives while the first is still in flight.
    with FakeEmailProvider(latency=(0.05, 0.05)) as p:
        results: list[tuple[int, dict[str, Any], bool]] = []
        lock = threading.Lock()

        def send() -> None:
            r = post(p, email(3), key="same")
            with lock:
                results.append(r)

        threads = [threading.Thread(target=send) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r[0] for r in results] == [200] * 8
        assert len({r[1]["id"] for r in results}) == 1
        assert sorted(r[2] for r in results) == [False] + [True] * 7
        s = p.stats()
        assert (s.accepted, s.suppressed, s.duplicate_emails) == (1, 7, 0)


def test_bad_requests(provider: FakeEmailProvider) -> None:
    assert post(provider, b"not json")[0] == 400
    assert post(provider, {"to": "a@example.com"})[0] == 400
    assert post(provider, email(1), path="/other")[0] == 404
    s = provider.stats()
    assert s.accepted == 0
    assert s.rejected == 2


def test_latency_must_be_an_ordered_pair() -> None:
    with pytest.raises(ValueError, match="latency"):
        FakeEmailProvider(latency=(0.005, 0.001))
