"""Fault timelines: schema errors name their path; events fire on time against a real proxy."""

from __future__ import annotations

import asyncio
import statistics
from pathlib import Path

import pytest
from faults_helpers import round_trips

from pdx.errors import ConfigError
from pdx.faults import FaultProxy
from pdx.faults.timeline import load_timeline, parse_timeline, run_timeline

GOOD = """
events:
  - at_s: 30
    add: {type: latency, name: wan, latency_ms: 50}
  - at_s: 60
    link_down: {duration_s: 10}
  - at_s: 45
    update: {name: wan, latency_ms: 80, jitter_ms: 5}
  - at_s: 90
    remove: wan
"""


def test_valid_timeline_parses_and_sorts(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(GOOD)
    timeline = load_timeline(path)
    assert [e.action for e in timeline.events] == ["add", "link_down", "update", "remove"]
    assert timeline.duration_s == 90
    assert timeline.events[1].describe() == "link down (reset) for 10.0 s"


def test_each_problem_is_one_line_with_its_path() -> None:
    bad = {
        "events": [
            {"at_s": -1, "add": {"type": "latency", "latency_ms": 5}},
            {"at_s": 2, "add": {"type": "latency", "latency_ms": float("nan")}},
            {"at_s": 3, "add": {"type": "wormhole"}},
            {"at_s": 4},
            {"at_s": 5, "remove": "x", "link_up": True},
            {"at_s": 6, "link_down": {"duration_s": 1, "colour": "red"}},
        ]
    }
    with pytest.raises(ConfigError) as info:
        parse_timeline(bad, source="t.yaml")
    problems = info.value.problems
    text = "\n".join(problems)
    assert "events[0].at_s: Input should be greater than or equal to 0 (got -1)" in text
    assert "events[1].add.latency_ms: Input should be a finite number" in text
    assert "events[2].add: Input tag 'wormhole'" in text
    assert "events[3]: Value error, exactly one action" in text
    assert "events[4]: Value error, exactly one action" in text
    assert "events[5].link_down.colour: unknown key" in text
    assert all("\n" not in p for p in problems)


def test_update_of_a_timeline_toxic_is_checked() -> None:
    bad = [
        {"at_s": 0, "add": {"type": "latency", "name": "wan"}},
        {"at_s": 1, "update": {"name": "wan", "latency_ms": -3}},
    ]
    with pytest.raises(ConfigError, match=r"events\[1\].update: .*latency_ms"):
        parse_timeline(bad)


async def test_timeline_runs_on_time_against_a_proxy(echo_port: int) -> None:
    timeline = parse_timeline(
        [
            {"at_s": 0.0, "add": {"type": "latency", "name": "wan", "latency_ms": 20}},
            # The latency stays a full second: two 40 ms round trips must fit inside it even
            # when the shared host stalls for a few hundred milliseconds.
            {"at_s": 1.0, "remove": "wan"},
            {"at_s": 1.05, "remove": "never-added"},
        ]
    )
    async with FaultProxy(("127.0.0.1", 0), ("127.0.0.1", echo_port)) as proxy:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        task = asyncio.create_task(run_timeline(proxy, timeline))
        await asyncio.sleep(0.05)
        slow = await round_trips(reader, writer, 2)
        records = await task
        fast = await round_trips(reader, writer, 2)
        writer.close()
    assert min(slow) >= 40 and statistics.median(fast) < 20
    assert [r["ok"] for r in records] == [True, True, False]
    assert "never-added" in records[2]["error"]
    assert 1.0 <= records[1]["actual_s"] < 1.15  # never early; late only by host scheduling
