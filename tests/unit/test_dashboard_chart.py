"""The dashboard's pieces that need no database: the chart's buckets, the signed cookies."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

pytest.importorskip("starlette", reason="the dashboard extra (starlette) is not installed")

from skiplock.dashboard._chart import RANGES, bucket_counts, throughput_svg
from skiplock.dashboard._data import age
from skiplock.dashboard._security import Signer


def at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def test_rows_land_in_their_bucket_and_old_ones_drop_out() -> None:
    rng = RANGES["1h"]  # 60 buckets of 60 s
    now = 1_700_000_030.0  # 30 s into the bucket starting at 1_700_000_000 (a multiple of 60)
    rows = [
        {"queue": "a", "status": "done", "at": at(1_700_000_000), "jobs": 3},
        {"queue": "b", "status": "done", "at": at(1_700_000_000), "jobs": 2},
        {"queue": "a", "status": "failed", "at": at(1_700_000_000 - 60), "jobs": 1},
        {"queue": "a", "status": "done", "at": at(1_700_000_000 - 3600), "jobs": 9},  # too old
    ]
    counts = bucket_counts(rows, rng, now)
    assert len(counts) == 60
    assert counts[-1] == {"done": 5, "failed": 0, "cancelled": 0}
    assert counts[-2] == {"done": 0, "failed": 1, "cancelled": 0}
    assert sum(sum(c.values()) for c in counts) == 6


def test_the_svg_counts_and_escapes() -> None:
    rng = RANGES["15m"]
    rows = [{"queue": "<q>", "status": "cancelled", "at": at(900.0), "jobs": 4}]
    svg = throughput_svg(rows, rng, 905.0)
    assert svg.startswith("<svg") and svg.endswith("</svg>")
    assert 'data-total="4"' in svg and svg.count('class="bar bar-cancelled"') == 1
    assert "<q>" not in svg
    assert throughput_svg([], rng, 905.0).count("<rect") == 0


def test_flash_cookies_are_signed() -> None:
    signer = Signer(b"k" * 32)
    cookie = signer.dump_flash("error", "no job with id 7")
    assert signer.load_flash(cookie) == ("error", "no job with id 7")
    body, _, sig = cookie.rpartition(".")
    forged = Signer(b"x" * 32).dump_flash("ok", "all good")
    assert signer.load_flash(forged) is None
    assert signer.load_flash(body + "." + "0" * len(sig)) is None
    assert signer.load_flash("garbage") is None and signer.load_flash(None) is None
    assert not signer.csrf_ok("nonce", None) and not signer.csrf_ok(None, "t")
    assert signer.csrf_ok("nonce", signer.csrf_token("nonce"))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "-"),
        (4.25, "4.2s"),
        (190, "3m 10s"),
        (7500, "2h 5m"),
        (3 * 86400 + 4 * 3600, "3d 4h"),
    ],
)
def test_ages_read_like_an_operator_would(seconds: float | None, text: str) -> None:
    assert age(seconds) == text
