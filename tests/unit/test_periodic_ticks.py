"""Tick computation with a fixed clock: seconds, DST, catch-up policies, bad specs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from skiplock import ConfigError, Periodic, Worker
from skiplock._periodic import MAX_CATCH_UP, check_periodic, next_tick, plan_ticks


def utc(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)  # type: ignore[misc]


def spec(cron: str, **kw: Any) -> Periodic:
    return Periodic(kw.pop("name", "p"), cron, **kw)


# -- the cron fields ----------------------------------------------------------------------


def test_six_fields_put_seconds_first() -> None:
    s = spec("*/15 * * * * *")
    now = utc(2024, 5, 1, 12, 0, 31)
    assert next_tick(s, now) == utc(2024, 5, 1, 12, 0, 45)
    assert plan_ticks(s, utc(2024, 5, 1, 12, 0, 0), now).ticks == [
        utc(2024, 5, 1, 12, 0, 15),
        utc(2024, 5, 1, 12, 0, 30),
    ]
    # second 30 of minute 0, every hour
    assert next_tick(spec("30 0 * * * *"), utc(2024, 5, 1, 12, 0, 31)) == utc(2024, 5, 1, 13, 0, 30)


def test_five_fields_are_minutes() -> None:
    s = spec("*/10 * * * *")
    assert next_tick(s, utc(2024, 5, 1, 12, 0, 0)) == utc(2024, 5, 1, 12, 10)


def test_now_itself_is_due() -> None:
    s = spec("* * * * * *")
    now = utc(2024, 5, 1, 12, 0, 5)
    assert plan_ticks(s, utc(2024, 5, 1, 12, 0, 4), now).ticks == [now]
    assert plan_ticks(s, now, now).ticks == []  # already enqueued
    assert plan_ticks(s, now, now + timedelta(microseconds=999_999)).ticks == []


def test_timezone_reads_the_fields_in_local_time() -> None:
    s = spec("0 9 * * *", timezone="America/New_York")
    # 09:00 EDT is 13:00 UTC in May
    assert next_tick(s, utc(2024, 5, 1, 0, 0)) == utc(2024, 5, 1, 13, 0)
    # 09:00 EST is 14:00 UTC in January
    assert next_tick(s, utc(2024, 1, 10, 0, 0)) == utc(2024, 1, 10, 14, 0)


def test_dst_spring_forward_runs_the_skipped_time_at_the_change() -> None:
    # Europe/Berlin, 2024-03-31: 02:00 CET jumps to 03:00 CEST (01:00 UTC).
    s = spec("30 2 * * *", timezone="Europe/Berlin")
    assert next_tick(s, utc(2024, 3, 30, 23, 0)) == utc(2024, 3, 31, 1, 0)
    assert next_tick(s, utc(2024, 3, 31, 1, 0)) == utc(2024, 4, 1, 0, 30)


def test_dst_fall_back_fixed_time_runs_once_wildcard_hour_twice() -> None:
    # Europe/Berlin, 2024-10-27: 03:00 CEST falls back to 02:00 CET (01:00 UTC);
    # local 02:30 happens at 00:30 and 01:30 UTC.
    fixed = spec("30 2 * * *", timezone="Europe/Berlin", catch_up="all")
    day = plan_ticks(fixed, utc(2024, 10, 26, 12), utc(2024, 10, 27, 12)).ticks
    assert day == [utc(2024, 10, 27, 0, 30)]
    hourly = spec("30 * * * *", timezone="Europe/Berlin", catch_up="all")
    ticks = plan_ticks(hourly, utc(2024, 10, 27, 0, 0), utc(2024, 10, 27, 2, 0)).ticks
    assert ticks == [utc(2024, 10, 27, 0, 30), utc(2024, 10, 27, 1, 30)]


# -- catch-up ----------------------------------------------------------------------------

NOW = utc(2024, 5, 1, 12, 0, 0)
MINUTELY = "* * * * *"


def test_skip_drops_ticks_older_than_grace() -> None:
    s = spec(MINUTELY, grace=150)
    plan = plan_ticks(s, NOW - timedelta(hours=1), NOW)
    assert plan.ticks == [NOW - timedelta(minutes=2), NOW - timedelta(minutes=1), NOW]
    assert plan.dropped == (NOW - timedelta(minutes=59), NOW - timedelta(minutes=3))


def test_skip_with_nothing_late_drops_nothing() -> None:
    plan = plan_ticks(spec(MINUTELY), NOW - timedelta(minutes=1), NOW + timedelta(seconds=3))
    assert plan.ticks == [NOW] and plan.dropped is None


def test_skip_after_long_downtime_with_no_tick_in_grace_enqueues_nothing() -> None:
    s = spec("0 * * * *")  # hourly, grace 60 s
    plan = plan_ticks(s, NOW - timedelta(hours=5), NOW + timedelta(minutes=30))
    assert plan.ticks == []
    assert plan.dropped == (NOW - timedelta(hours=4), NOW)


def test_latest_enqueues_only_the_newest_missed_tick() -> None:
    s = spec("0 * * * *", catch_up="latest")
    plan = plan_ticks(s, NOW - timedelta(hours=5), NOW + timedelta(minutes=30))
    assert plan.ticks == [NOW]
    assert plan.dropped == (NOW - timedelta(hours=4), NOW - timedelta(hours=1))


def test_latest_within_grace_is_like_skip() -> None:
    s = spec(MINUTELY, catch_up="latest", grace=90)
    plan = plan_ticks(s, NOW - timedelta(minutes=10), NOW)
    assert plan.ticks == [NOW - timedelta(minutes=1), NOW]
    assert plan.dropped == (NOW - timedelta(minutes=9), NOW - timedelta(minutes=2))


def test_all_enqueues_every_missed_tick() -> None:
    s = spec("0 * * * *", catch_up="all")
    plan = plan_ticks(s, NOW - timedelta(hours=5), NOW + timedelta(minutes=30))
    assert plan.ticks == [NOW - timedelta(hours=h) for h in range(4, -1, -1)]
    assert plan.dropped is None


def test_all_is_capped_to_the_most_recent_ticks() -> None:
    s = spec("* * * * * *", catch_up="all")
    last = NOW - timedelta(seconds=MAX_CATCH_UP + 500)
    plan = plan_ticks(s, last, NOW)
    assert len(plan.ticks) == MAX_CATCH_UP
    assert plan.ticks[-1] == NOW
    assert plan.ticks[0] == NOW - timedelta(seconds=MAX_CATCH_UP - 1)
    assert plan.dropped == (last + timedelta(seconds=1), NOW - timedelta(seconds=MAX_CATCH_UP))


@pytest.mark.parametrize("policy", ["skip", "all", "latest"])
def test_no_history_enqueues_at_most_the_newest_tick(policy: str) -> None:
    s = spec(MINUTELY, catch_up=policy, grace=130)
    plan = plan_ticks(s, None, NOW + timedelta(seconds=5))
    assert plan.ticks == [NOW] and plan.dropped is None
    hourly = spec("0 * * * *", catch_up=policy, grace=130)
    assert plan_ticks(hourly, None, NOW + timedelta(seconds=130)).ticks == [NOW]
    assert plan_ticks(hourly, None, NOW + timedelta(seconds=131)).ticks == []


def test_a_rare_cron_plans_nothing_until_it_fires() -> None:
    s = spec("0 0 * 2 MON#5")  # a fifth Monday in February: 2044-02-29
    assert plan_ticks(s, None, NOW).ticks == []
    assert next_tick(s, NOW) == utc(2044, 2, 29)
    with pytest.raises(ConfigError, match="30 2"):
        spec("0 0 30 2 *")  # 30 February never comes: cronsim refuses it


def test_naive_now_is_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        plan_ticks(spec(MINUTELY), None, datetime(2024, 1, 1))


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expect"),
    [
        ({"cron": "61 * * * *"}, "invalid cron expression '61 * * * *'"),
        ({"cron": "* * *"}, "invalid cron expression '* * *'"),
        ({"cron": ""}, "invalid cron expression ''"),
        ({"cron": "* * * * * * *"}, "invalid cron expression"),
        ({"timezone": "Mars/Olympus"}, "unknown timezone 'Mars/Olympus'"),
        ({"timezone": "../etc/passwd"}, "unknown timezone '../etc/passwd'"),
        ({"timezone": ""}, "unknown timezone ''"),
        ({"catch_up": "some"}, "catch_up must be 'skip', 'all' or 'latest', not 'some'"),
        ({"grace": 0}, "grace must be a positive number of seconds, not 0"),
        ({"grace": float("inf")}, "grace must be a positive number"),
        ({"queue": "bad queue"}, "invalid queue name 'bad queue'"),
        ({"max_attempts": 0}, "max_attempts must be an integer from 1"),
        ({"priority": 2**31}, "priority must be an integer"),
        ({"payload": {"x": float("nan")}}, "payload is not JSON-serialisable"),
        ({"name": ""}, "invalid periodic name ''"),
        ({"name": "a b"}, "invalid periodic name 'a b'"),
    ],
)
def test_bad_specs_are_one_line_config_errors(kwargs: dict[str, Any], expect: str) -> None:
    args = {"name": "nightly", "cron": "0 3 * * *", **kwargs}
    with pytest.raises(ConfigError) as info:
        Periodic(**args)
    assert expect in str(info.value)
    assert "\n" not in str(info.value)


def test_duplicate_names_are_refused() -> None:
    a, b = Periodic("same", "* * * * *"), Periodic("same", "0 * * * *")
    with pytest.raises(ConfigError, match="duplicate periodic name 'same'"):
        check_periodic([a, b])
    with pytest.raises(ConfigError, match="duplicate periodic name 'same'"):
        Worker(None, lambda job: None, periodic=[a, b])  # type: ignore[arg-type]


def test_default_payload_names_the_schedule_and_tick() -> None:
    s = Periodic("nightly", "0 3 * * *")
    assert s.payload_for(utc(2024, 1, 2, 3)) == (
        '{"periodic":"nightly","scheduled_at":"2024-01-02T03:00:00+00:00"}'
    )
    assert Periodic("n", "0 3 * * *", payload={"a": 1}).payload_for(NOW) == '{"a":1}'
