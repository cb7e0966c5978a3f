"""WAN timelines: conditions of the router hop over time, as validated YAML.

The same shape as the proxy's timelines (:mod:`pdx.faults.timeline`): a list of events, each
with ``at_s`` and exactly one action:

- ``set``: condition fields to change, for both directions (``delay_ms: 40``) or per
  direction (``down: {loss: 0.01}``); fields not named keep their value;
- ``cut``: a packet-level cut of the whole link (every packet dropped, no reset), for
  ``duration_s`` seconds or until a ``restore`` event;
- ``restore``: end a cut;
- ``reset``: back to the conditions in force when the timeline started.

Example: RTT 20 → 80 ms at 30 s, a loss burst, a 2 s cut::

    events:
      - {at_s: 0, set: {delay_ms: 10}}
      - {at_s: 30, set: {delay_ms: 40}}
      - {at_s: 40, set: {loss: 0.05, loss_model: gilbert, loss_burst: 8}}
      - {at_s: 45, set: {loss: 0}}
      - {at_s: 50, cut: {duration_s: 2}}
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdx.config import build_config, read_yaml
from pdx.errors import PdxError
from pdx.faults.wan.conditions import DIRECTIONS, LinkConditions, WanConditions

ACTIONS = ("set", "cut", "restore", "reset")
_FIELDS = set(LinkConditions.model_fields)


class Cut(BaseModel):
    """A packet-level cut, for ``duration_s`` seconds (None = until a ``restore`` event)."""

    model_config = ConfigDict(extra="forbid")
    duration_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None


class WanEvent(BaseModel):
    """One timed change of the router hop's conditions."""

    model_config = ConfigDict(extra="forbid")
    at_s: Annotated[float, Field(ge=0, allow_inf_nan=False)]
    set: dict[str, Any] | None = None
    cut: Cut | None = None
    restore: bool | None = None
    reset: bool | None = None

    @model_validator(mode="after")
    def _one_action(self) -> WanEvent:
        given = [a for a in ACTIONS if getattr(self, a) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"exactly one action of {', '.join(ACTIONS)} (got {given or 'none'})")
        if self.set is not None:
            for key, value in self.set.items():
                if key in DIRECTIONS:
                    if not isinstance(value, dict) or set(value) - _FIELDS:
                        raise ValueError(f"set.{key}: a mapping of {sorted(_FIELDS)}")
                elif key not in _FIELDS:
                    raise ValueError(f"set.{key}: unknown; known: up, down, {sorted(_FIELDS)}")
        return self

    def describe(self) -> str:
        """Short text, e.g. ``set delay_ms=40`` or ``cut for 2 s``."""
        if self.set is not None:
            return "set " + " ".join(f"{k}={v}" for k, v in self.set.items())
        if self.cut is not None:
            span = "" if self.cut.duration_s is None else f" for {self.cut.duration_s:g} s"
            return f"cut{span}"
        return "restore" if self.restore else "reset"


class WanTimeline(BaseModel):
    """A validated WAN timeline; events run in ``at_s`` order."""

    model_config = ConfigDict(extra="forbid")
    events: list[WanEvent] = Field(default_factory=list)

    @property
    def duration_s(self) -> float:
        """When the last event (or the end of the last timed cut) happens."""
        ends = [e.at_s + (e.cut.duration_s or 0) if e.cut else e.at_s for e in self.events]
        return max(ends, default=0.0)

    def plan(self) -> list[tuple[float, WanEvent]]:
        """Events in time order, a timed cut followed by its own restore."""
        out = [(e.at_s, e) for e in self.events]
        for e in self.events:
            if e.cut is not None and e.cut.duration_s is not None:
                out.append((e.at_s + e.cut.duration_s, WanEvent(at_s=e.at_s, restore=True)))
        return sorted(out, key=lambda item: item[0])


def parse_wan_timeline(data: Any, source: str = "timeline") -> WanTimeline:
    """Validate a timeline document (one line per bad field)."""
    if isinstance(data, list):
        data = {"events": data}
    return build_config(WanTimeline, source=source, base=data)


def load_wan_timeline(path: Path | str) -> WanTimeline:
    """Read and validate a timeline YAML file."""
    return parse_wan_timeline(read_yaml(path), source=str(path))


def apply_event(current: WanConditions, start: WanConditions, event: WanEvent) -> WanConditions:
    """The conditions after ``event``."""
    if event.reset:
        return start
    if event.cut is not None:
        return current.model_copy(update={"cut": True})
    if event.restore:
        return current.model_copy(update={"cut": False})
    assert event.set is not None
    both = {k: v for k, v in event.set.items() if k not in DIRECTIONS}
    data = current.model_dump()
    for d in DIRECTIONS:
        data[d] = {**data[d], **both, **event.set.get(d, {})}
    return WanConditions.model_validate(data)


def run_wan_timeline(
    timeline: WanTimeline,
    start: WanConditions,
    apply: Callable[[WanConditions], Any],
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[dict[str, Any]]:
    """Apply each event at its time (bounded by the timeline's own length); one record each."""
    t0 = clock()
    current = start
    records = []
    for at_s, event in timeline.plan():
        wait = t0 + at_s - clock()
        if wait > 0:
            sleep(wait)
        record: dict[str, Any] = {"at_s": at_s, "what": event.describe()}
        try:
            current = apply_event(current, start, event)
            apply(current)
            record.update(ok=True, error=None)
        except (PdxError, ValueError) as exc:  # a failed event is recorded; the rest go on
            record.update(ok=False, error=str(exc))
        record["actual_s"] = round(clock() - t0, 3)
        records.append(record)
    return records
