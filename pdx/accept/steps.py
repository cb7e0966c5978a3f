"""The matrix as steps: network condition (outer) × input length × output length × load (or ×
trace workload × rate), each step once per offload policy when ``matrix.offload`` compares
them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdx.accept.playbook import Criteria, Playbook


@dataclass(frozen=True)
class Step:
    """One cell of the matrix under one network condition."""

    index: int
    input_tokens: int
    output_tokens: int
    concurrency: int | None
    rate_rps: float | None
    network: str
    duration_s: float
    # a trace step: the workload's name and the time scale its replay runs at (its lengths
    # above are the window's longest, its rate the window's mean at that scale)
    workload: str | None = None
    time_scale: float | None = None
    # matrix.offload: the policy every request of the step asks for (pdx_offload), and the
    # matrix cell the step is one policy's run of (steps of one cell are compared)
    offload: str | None = None
    cell: int | None = None
    threshold_tokens: int | None = None  # --search router.offload.threshold_tokens: the probe's

    @property
    def id(self) -> str:
        """A stable, file-name-safe identifier such as ``s02-in32-out16-c4-link-break`` (a
        trace step: ``s03-chat-r2.5-normal``; under matrix.offload ``…-normal-uncached``)."""
        load = f"c{self.concurrency}" if self.concurrency is not None else f"r{self.rate_rps:g}"
        tail = f"-{self.offload}" if self.offload else ""
        tail += f"-t{self.threshold_tokens}" if self.threshold_tokens is not None else ""
        if self.workload is not None:
            return (
                f"s{self.index:02d}-{self.workload}-r{self.rate_rps or 0:.3g}-{self.network}{tail}"
            )
        return (
            f"s{self.index:02d}-in{self.input_tokens}-out{self.output_tokens}-{load}-"
            f"{self.network}{tail}"
        )

    @property
    def target_load(self) -> float:
        """Users (closed loop) or requests/s (open loop) the step asks for."""
        return float(self.concurrency if self.concurrency is not None else self.rate_rps or 0.0)


def expand_steps(pb: Playbook) -> list[Step]:
    """The matrix as an ordered list of steps (network outermost, then in, out, load; or
    network, workload, rate for trace steps)."""
    m = pb.matrix
    if m.workload is not None:
        return _per_policy(_trace_steps(pb), m.offload, m.offload_rounds)
    loads: list[tuple[int | None, float | None]] = (
        [(c, None) for c in m.concurrency]
        if m.concurrency
        else [(None, r) for r in m.rate_rps or []]
    )
    combos = itertools.product(m.network, m.input_tokens or [], m.output_tokens or [], loads)
    kept = [c for c in combos if not any(_matches(cell, *c[:3], *c[3]) for cell in m.exclude)]
    steps = [
        Step(i, inp, out, conc, rate, net, pb.step_duration_s(net)[0])
        for i, (net, inp, out, (conc, rate)) in enumerate(kept)
    ]
    return _per_policy(steps, m.offload, m.offload_rounds)


def _per_policy(steps: list[Step], policies: Sequence[str] | None, rounds: int) -> list[Step]:
    """Each cell once per offload policy and round, the order reversed from one round (and
    one cell) to the next — A B, B A, … — so neither policy always runs first."""
    if not policies:
        return steps
    out: list[Step] = []
    flip = False
    for step in steps:
        for _ in range(rounds):
            for policy in reversed(policies) if flip else policies:
                out.append(replace(step, index=len(out), offload=policy, cell=step.index))
            flip = not flip
    return out


def _trace_steps(pb: Playbook) -> list[Step]:
    """Each workload under each network condition (and each matrix.rate_rps, its pace)."""
    from pdx.traces.formats import read_trace
    from pdx.traces.prompts import scaled
    from pdx.traces.schedule import Window, plan

    m = pb.matrix
    steps: list[Step] = []
    for net in m.network:
        for name in m.workload or []:
            w = pb.load.workloads[name]
            trace = read_trace(w.trace, w.format, block_size=w.block_size,
                               field_name=f"load.workloads.{name}.trace")  # fmt: skip
            rates: list[float | None] = list(m.rate_rps or []) or [None]
            for rate in rates:
                window = Window(w.start_s, w.duration_s, w.max_requests, w.time_scale, rate)
                planned, scale = plan(trace, window)
                span = planned[-1].send_s
                mean = (len(planned) - 1) / span if span > 0 else float(len(planned))
                steps.append(Step(
                    index=len(steps),
                    input_tokens=max(scaled(p.request.input_tokens, w.length_scale)
                                     for p in planned),
                    output_tokens=max(scaled(p.request.output_tokens, w.length_scale)
                                      for p in planned),
                    concurrency=None,
                    rate_rps=round(mean, 4),
                    network=net,
                    duration_s=pb.step_duration_s(net)[0],
                    workload=name,
                    time_scale=scale,
                ))  # fmt: skip
    return steps


def _matches(
    cell: dict[str, Any], net: str, inp: int, out: int, conc: int | None, rate: float | None
) -> bool:
    """Whether a step is the ``matrix.exclude`` entry ``cell`` (every key it names agrees)."""
    values: dict[str, Any] = {"network": net, "input_tokens": inp, "output_tokens": out,
                              "concurrency": conc, "rate_rps": rate}  # fmt: skip

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, int | float) and isinstance(b, int | float):
            return float(a) == float(b)
        return str(a) == str(b)

    return all(same(values[k], v) for k, v in cell.items())


def step_criteria(pb: Playbook, step: Step) -> Criteria:
    """The global criteria with this step's condition overrides applied."""
    overrides = pb.conditions[step.network].criteria
    if not overrides:
        return pb.criteria
    return Criteria.model_validate({**pb.criteria.model_dump(), **overrides})
