"""Timestamps: one format everywhere, whatever the moment."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime

from hypothesis import given
from hypothesis import strategies as st

from ksi_common.timefmt import format_ts, parse_ts, utc_now

ISO_Z = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


@given(st.floats(min_value=0, max_value=4_102_444_800, allow_nan=False))  # 1970 .. 2100
def test_a_moment_is_written_with_microseconds_and_a_z_and_read_back(moment: float) -> None:
    text = format_ts(moment)
    assert ISO_Z.fullmatch(text), text
    assert text == datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert abs(parse_ts(text) - moment) < 1e-5


def test_whole_seconds_keep_their_zero_microseconds() -> None:
    assert format_ts(0) == "1970-01-01T00:00:00.000000Z"
    assert format_ts(1_000_000_000) == "2001-09-09T01:46:40.000000Z"
    assert ISO_Z.fullmatch(utc_now())


def test_the_current_time_is_the_clocks_and_later_calls_never_read_earlier() -> None:
    """utc_now formats each second's text once and reuses it: a reused second must not go stale."""
    readings = []
    deadline = time.time() + 1.2  # across at least one change of second
    while time.time() < deadline:
        before = time.time()
        text = utc_now()
        after = time.time()
        assert ISO_Z.fullmatch(text), text
        assert before - 1e-6 <= parse_ts(text) <= after + 1e-6, (before, text, after)
        readings.append(text)
    assert readings == sorted(readings)
    assert len({text[:19] for text in readings}) >= 2
