"""Fault timelines: "at 30 s add latency 50 ms; at 60 s link down for 10 s" as validated YAML.

A timeline is a list of events, each with ``at_s`` (seconds from the start) and exactly one
action: ``add`` (a toxic), ``update`` (``name`` plus changed fields), ``remove`` (a name),
``link_down`` (``duration_s``, ``mode``), ``link_up`` or ``clear``. Runs against an in-process
:class:`~pdx.faults.proxy.FaultProxy` or a remote one through its HTTP API.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdx.config import build_config, read_yaml
from pdx.errors import ConfigError, PdxError
from pdx.faults import toxics as tx
from pdx.faults.tcp import sleep_until

ACTIONS = ("add", "update", "remove", "link_down", "link_up", "clear")


class LinkDown(BaseModel):
    """Take the link down, for ``duration_s`` seconds (None = until a ``link_up`` event)."""

    model_config = ConfigDict(extra="forbid")
    duration_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    mode: Literal["reset", "blackhole"] = "reset"


class Event(BaseModel):
    """One timed action."""

    model_config = ConfigDict(extra="forbid")
    at_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    add: tx.ToxicSpec | None = None
    update: dict[str, Any] | None = None
    remove: str | None = None
    link_down: LinkDown | None = None
    link_up: bool | None = None
    clear: bool | None = None

    @model_validator(mode="after")
    def _exactly_one_action(self) -> Event:
        given = [a for a in ACTIONS if getattr(self, a) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"exactly one action of {', '.join(ACTIONS)} (got {given or 'none'})")
        if self.update is not None and not isinstance(self.update.get("name"), str):
            raise ValueError("update needs the 'name' of the toxic to change")
        return self

    @property
    def action(self) -> str:
        """Which action this event performs."""
        return next(a for a in ACTIONS if getattr(self, a) not in (None, False))

    def describe(self) -> str:
        """Short human text, e.g. ``add latency latency_both``."""
        if self.add is not None:
            return f"add {self.add.type} {self.add.name or ''}".strip()
        if self.update is not None:
            return f"update {self.update['name']}"
        if self.remove is not None:
            return f"remove {self.remove}"
        if self.link_down is not None:
            span = (
                "" if self.link_down.duration_s is None else f" for {self.link_down.duration_s} s"
            )
            return f"link down ({self.link_down.mode}){span}"
        return "link up" if self.link_up else "clear toxics"


class Timeline(BaseModel):
    """A validated fault timeline; events run in ``at_s`` order."""

    model_config = ConfigDict(extra="forbid")
    events: list[Event] = Field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """When the last event (including a timed link-down) ends."""
        ends = [
            e.at_s + (e.link_down.duration_s or 0.0 if e.link_down else 0.0) for e in self.events
        ]
        return max(ends, default=0.0)


def parse_timeline(data: Any, *, source: str = "timeline") -> Timeline:
    """Validate a mapping (``{"events": [...]}``) or a bare list of events."""
    if isinstance(data, list):
        data = {"events": data}
    if not isinstance(data, dict):
        raise ConfigError(source, [f"(root): expected a mapping with 'events', got {data!r}"])
    try:
        timeline = build_config(Timeline, source=source, base=data)
    except ConfigError as exc:
        raise ConfigError(source, [_strip_tag(p) for p in exc.problems]) from None
    _check_updates(timeline, source)
    return timeline


def load_timeline(path: Path | str) -> Timeline:
    """Read and validate a timeline YAML file."""
    return parse_timeline(read_yaml(path), source=str(path))


def _strip_tag(problem: str) -> str:
    """``events[1].add.latency.latency_ms`` → ``events[1].add.latency_ms``."""
    for kind in tx.ALL_TYPES:
        problem = problem.replace(f".add.{kind}.", ".add.")
    return problem


def _check_updates(timeline: Timeline, source: str) -> None:
    """Updates of toxics the timeline itself added must still validate."""
    known: dict[str, tx.Toxic] = {}
    problems: list[str] = []
    for i, event in enumerate(sorted(timeline.events, key=lambda e: e.at_s)):
        if event.add is not None:
            known[event.add.name or f"{event.add.type}_{event.add.direction}"] = event.add
        elif event.update is not None and event.update["name"] in known:
            try:
                tx.updated_toxic(known[event.update["name"]], event.update)
            except PdxError as exc:
                problems.append(f"events[{i}].update: {' '.join(str(exc).split())}")
    if problems:
        raise ConfigError(source, problems)


class Target(Protocol):
    """What a timeline drives: a FaultProxy, or a client of the HTTP API."""

    def add_toxic(self, toxic: Any) -> Any: ...
    def update_toxic(self, name: str, changes: dict[str, Any] | None = None) -> Any: ...
    def remove_toxic(self, name: str) -> Any: ...
    def link_up(self) -> Any: ...
    def clear_toxics(self) -> Any: ...


async def apply_event(target: Any, event: Event) -> None:
    """Perform one event on ``target`` (sync client calls run in a thread)."""
    if event.link_down is not None:
        down = target.link_down(duration_s=event.link_down.duration_s, mode=event.link_down.mode)
        if asyncio.iscoroutine(down):
            await down
        return
    call: Any
    if event.add is not None:
        call = (target.add_toxic, event.add)
    elif event.update is not None:
        changes = {k: v for k, v in event.update.items() if k != "name"}
        call = (target.update_toxic, event.update["name"], changes)
    elif event.remove is not None:
        call = (target.remove_toxic, event.remove)
    elif event.link_up:
        call = (target.link_up,)
    else:
        call = (target.clear_toxics,)
    if getattr(target, "blocking", False):
        await asyncio.to_thread(*call)
    else:
        call[0](*call[1:])


async def run_timeline(
    target: Any, timeline: Timeline, records: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Run every event at its time (monotonic clock); returns what happened and when.

    Records are appended to ``records`` as they happen (so a cancelled run keeps them). A
    failing event (e.g. removing an unknown toxic) is recorded with its error; the run goes on.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    records = [] if records is None else records
    for event in sorted(timeline.events, key=lambda e: e.at_s):
        await sleep_until(loop, start + event.at_s)
        record: dict[str, Any] = {
            "at_s": event.at_s,
            "action": event.action,
            "what": event.describe(),
        }
        try:
            await apply_event(target, event)
            record["ok"] = True
        except PdxError as exc:
            record.update(ok=False, error=" ".join(str(exc).split()))
        record["actual_s"] = round(loop.time() - start, 4)
        records.append(record)
    return records
