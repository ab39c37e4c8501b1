"""A FastAPI service that defers skiplock tasks and returns their results.

The web process only defers and waits (``defer_async``, ``wait_async``); a worker runs
the task.  Run both from this directory::

    export SKIPLOCK_DSN=postgresql://app@db/app        # unset: the embedded PostgreSQL
    skiplock worker --app fastapi_app:app               # the worker (migrates on start)
    uvicorn fastapi_app:api                             # the web service

    curl -X POST localhost:8000/orders -H 'content-type: application/json' \\
         -H 'Idempotency-Key: order-17' -d '{"sku": "apple", "qty": 3}'
    # {"job_id": 1}
    curl 'localhost:8000/orders/1/price?timeout=5'
    # {"sku": "apple", "qty": 3, "total_cents": 90, "attempt": 1}

``SKIPLOCK_DSN`` and ``SKIPLOCK_SCHEMA`` choose the database and schema (defaults: the
embedded server, schema ``skiplock``).  See docs/migrating.md.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException, Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

import skiplock
from skiplock import Fail, Job, JobCancelled, JobFailed, UnknownJob

# One App per process; nothing connects until the first deferral, wait or worker.
app = skiplock.App(
    os.environ.get("SKIPLOCK_DSN"), schema=os.environ.get("SKIPLOCK_SCHEMA", "skiplock")
)

PRICES_CENTS = {"apple": 30, "pear": 45}


@app.task(name="shop.price_order", queue="pricing", max_attempts=3)
async def price_order(sku: str, qty: int, job: Job) -> dict[str, Any]:
    """Price an order; the return value is stored as the job's result (JSON)."""
    if sku not in PRICES_CENTS:
        raise Fail(f"unknown sku {sku!r}")  # permanent: no retry
    await asyncio.sleep(0.01)  # stands in for a call to a pricing service
    return {"sku": sku, "qty": qty, "total_cents": PRICES_CENTS[sku] * qty, "attempt": job.attempts}


@asynccontextmanager
async def lifespan(_: FastAPI) -> AsyncIterator[None]:
    # Idempotent and advisory-locked: safe with many replicas starting at once.
    await (await app.async_queue()).migrate()
    try:
        yield
    finally:
        await app.aclose()  # the AsyncQueue's pool, and its LISTEN connection


api = FastAPI(title="skiplock + FastAPI", lifespan=lifespan)


class OrderIn(BaseModel):
    sku: str
    qty: int = Field(gt=0)


@api.post("/orders", status_code=202)
async def create_order(
    order: OrderIn, idempotency_key: Annotated[str | None, Header()] = None
) -> dict[str, int]:
    """Defer the pricing job; a repeated Idempotency-Key returns the first job's id."""
    deferral = price_order.configure(key=idempotency_key)
    job_id = await deferral.defer_async(sku=order.sku, qty=order.qty)
    return {"job_id": job_id}


@api.get("/orders/{job_id}/price", response_model=None)
async def order_price(
    job_id: int, timeout: Annotated[float, Query(gt=0, le=30)] = 5.0
) -> dict[str, Any] | JSONResponse:
    """The job's result, waiting up to ``timeout`` seconds (woken by NOTIFY, not polling)."""
    try:
        result: dict[str, Any] = await app.wait_async(job_id, timeout=timeout)
    except TimeoutError:
        return JSONResponse({"job_id": job_id, "status": "pending"}, status_code=202)
    except UnknownJob:
        raise HTTPException(404, f"no job {job_id}") from None
    except JobFailed as exc:
        raise HTTPException(422, str(exc)) from None
    except JobCancelled:
        raise HTTPException(409, f"job {job_id} was cancelled") from None
    return result
