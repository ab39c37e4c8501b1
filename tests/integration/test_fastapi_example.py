"""examples/fastapi_app.py for real: its endpoints, its lifespan and an AsyncWorker on
one event loop, against a real PostgreSQL and a fresh schema."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

pytest.importorskip("fastapi", reason="the test extra (fastapi) is not installed")
httpx2 = pytest.importorskip("httpx2", reason="the test extra (httpx2) is not installed")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fastapi_app.py"


def load_example(monkeypatch: pytest.MonkeyPatch, dsn: str, schema: str) -> types.ModuleType:
    """Import the example afresh, configured as its docstring says: by environment."""
    monkeypatch.setenv("SKIPLOCK_DSN", dsn)
    monkeypatch.setenv("SKIPLOCK_SCHEMA", schema)
    spec = importlib.util.spec_from_file_location("fastapi_app", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fastapi_app", module)
    spec.loader.exec_module(module)
    return module


def test_fastapi_example_defers_waits_and_closes(
    monkeypatch: pytest.MonkeyPatch,
    dsn: str,
    schema: str,
    admin: psycopg.Connection[Any],
) -> None:
    ex = load_example(monkeypatch, dsn, schema)
    assert ex.app.dsn == dsn and ex.app.schema == schema

    async def main() -> None:
        # The lifespan migrates the schema and, on the way out, closes the App.
        async with ex.api.router.lifespan_context(ex.api):
            worker = ex.app.async_worker(concurrency=4, sweep_interval=0.2)
            running = asyncio.create_task(worker.run())
            transport = httpx2.ASGITransport(app=ex.api)
            try:
                async with httpx2.AsyncClient(transport=transport, base_url="http://t") as c:
                    r = await c.post("/orders", json={"sku": "apple", "qty": 3})
                    assert r.status_code == 202, r.text
                    job_id = r.json()["job_id"]
                    r = await c.get(f"/orders/{job_id}/price", params={"timeout": 20})
                    assert r.status_code == 200, r.text
                    assert r.json() == {"sku": "apple", "qty": 3, "total_cents": 90, "attempt": 1}

                    # The same Idempotency-Key: one job, the same id.
                    headers = {"Idempotency-Key": "order-17"}
                    first = await c.post("/orders", json={"sku": "pear", "qty": 2}, headers=headers)
                    again = await c.post("/orders", json={"sku": "pear", "qty": 2}, headers=headers)
                    assert first.json()["job_id"] == again.json()["job_id"]
                    r = await c.get(f"/orders/{first.json()['job_id']}/price")
                    assert r.json()["total_cents"] == 90

                    # Fail(...) in the task: failed at once, no retry; the endpoint says why.
                    r = await c.post("/orders", json={"sku": "kiwi", "qty": 1})
                    bad = r.json()["job_id"]
                    r = await c.get(f"/orders/{bad}/price", params={"timeout": 20})
                    assert r.status_code == 422 and "unknown sku 'kiwi'" in r.json()["detail"]

                    # Bad input never reaches the queue; an unknown id is a 404.
                    r = await c.post("/orders", json={"sku": "apple", "qty": 0})
                    assert r.status_code == 422
                    assert (await c.get("/orders/999999/price")).status_code == 404

                    # Not done within the timeout: 202, still pending.
                    worker.stop()
                    await running
                    r = await c.post("/orders", json={"sku": "apple", "qty": 1})
                    late = r.json()["job_id"]
                    r = await c.get(f"/orders/{late}/price", params={"timeout": 0.2})
                    assert r.status_code == 202 and r.json()["status"] == "pending"
            finally:
                worker.stop()
                await running
        assert ex.app._aqueue is None  # aclose() ran

    asyncio.run(main())

    jobs = admin.execute(
        sql.SQL("SELECT task, status, attempts FROM {}.jobs ORDER BY id").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    assert jobs == [
        ("shop.price_order", "done", 1),
        ("shop.price_order", "done", 1),
        ("shop.price_order", "failed", 1),
        ("shop.price_order", "pending", 0),
    ]
