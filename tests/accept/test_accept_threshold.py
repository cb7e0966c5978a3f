"""The threshold search's choice: the least egress among the thresholds the sample cannot tell
from the best goodput, GO only, and its bracket of such neighbours."""

from __future__ import annotations

from typing import Any

from pdx.accept.search.threshold import choose, ladder, settings


def point(value: int, rps: float, lo: float, hi: float, kv: int, verdict: str = "GO") -> Any:
    return {"value": value, "verdict": verdict, "kv_bytes": kv,
            "goodput_rps": {"value": rps, "interval": [lo, hi]}}  # fmt: skip


def test_the_ladder_doubles_up_to_the_range_or_the_longest_prompt() -> None:
    assert ladder(16, 64, 1000) == [16, 32, 64]
    assert ladder(16, 8192, 100) == [16, 32, 64, 100]  # past 100 every prompt is local anyway
    assert ladder(8, 10, 1000) == [8, 10]


def test_the_pick_ships_least_among_those_as_good_as_the_best() -> None:
    points = [
        point(16, 5.0, 4.5, 5.5, 900),
        point(32, 5.6, 5.1, 6.1, 600),  # the best
        point(64, 5.3, 4.8, 5.8, 300),  # the sample cannot tell it from the best: fewer bytes
        point(128, 5.2, 4.7, 5.7, 100, "NO-GO"),  # as good, but not GO
        point(256, 3.0, 2.5, 3.4, 0),  # wholly below the best
    ]
    got = choose(points)
    assert got["best"] == 32 and got["same"] == [16, 32, 64, 128]
    assert got["pick"] == 64 and got["bracket"] == [16, 128]
    assert choose([point(16, 1.0, 0.5, 1.5, 10, "NO-GO")]) == {"best": 16, "same": [16]}
    assert choose([]) == {}


def test_settings_are_offered_for_other_routers_only_under_their_rule() -> None:
    s = settings(64, "uncached")
    assert s is not None and "nonCachedTokens: 64" in s["llm-d"]
    assert '"eff_isl_threshold": 64' in s["dynamo"] and "threshold_tokens: 64" in s["pdx"]
    other = settings(64, "length")
    assert other is not None and "llm-d" not in other and "length" in other["why_not_others"]
