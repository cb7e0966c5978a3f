"""The KV each step will hold, from measure-kv on the deployed model, against the deploy's
budgets and this machine's memory: sized before anything starts.

Per step, with ``in_flight`` requests at once (its concurrency; an open-loop step's rate ×
``judgement.request_deadline_s``, else ``load.timeout_s``):

- each prefill instance's KV store holds the objects of its share of them from Put to
  decode's release: ``ceil(in_flight / prefill.count) × KV(input) × HEADROOM``;
- each decode instance reserves its share's KV at its longest (``pdx.serving.admission``):
  ``ceil(in_flight / decode.count) × KV(input + output) × HEADROOM``.

``HEADROOM`` (a quarter more) holds what outlives its request for a moment: an object awaiting
release, the encoding's overhead, a cancelled request's reservation until decode sees the
cancel, a request the router counts as ended before decode's next Status says so.

A budget the deploy leaves at its default and that is below the largest step's need is raised
to that need (the deploy gets it with ``--set``, and the pre-flight says so); one the playbook
set itself is kept, and the pre-flight says which steps will wait or be refused for it. When
the machine cannot hold the largest step's KV at all (store and decode together above
``MEMORY_SHARE`` of its available memory), the run stops before it deploys anything.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pdx.accept.playbook import Playbook
from pdx.accept.steps import Step
from pdx.errors import ConfigError, PdxError
from pdx.units import human_bytes

HEADROOM = 1.25
MEMORY_SHARE = 0.8
STORE_KEY = "kv.store_budget_bytes"
DECODE_KEY = "decode.kv_budget_bytes"


class KVDoesNotFit(PdxError):
    """A step's KV is more than this machine can hold (exit 2, before anything starts)."""


def memory_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def in_flight(pb: Playbook, step: Step) -> int:
    """Requests a step has in flight at most (its users, or its rate over the deadline)."""
    if step.concurrency:
        return step.concurrency
    deadline_s = pb.judgement.request_deadline_s or pb.load.timeout_s
    return max(1, math.ceil((step.rate_rps or 0.0) * deadline_s))


def size_kv(pb: Playbook, playbook_dir: Path, steps: list[Step]) -> dict[str, Any] | None:
    """The sizing (see the module docstring), or None where pdx does not deploy its own pair.

    Raises :class:`KVDoesNotFit` when the machine cannot hold the largest step's KV.
    """
    from pdx.accept.preflight.kv import deploy_config, kv_bytes_at

    if pb.target.deploy is None or not steps:
        return None
    try:
        cfg = deploy_config(pb.target, playbook_dir)
    except ConfigError:  # the deploy names its own bad config when it starts
        return None
    if cfg.engine != "pdx":
        return None
    seqs = sorted({s.input_tokens for s in steps} | {s.input_tokens + s.output_tokens
                                                      for s in steps})  # fmt: skip
    kv = kv_bytes_at(pb, playbook_dir, seqs)
    rows = []
    for s in steps:
        n = in_flight(pb, s)
        rows.append({
            "step": s.id,
            "in_flight": n,
            "kv_prompt_bytes": kv[s.input_tokens],
            "kv_request_bytes": kv[s.input_tokens + s.output_tokens],
            "store_bytes": math.ceil(
                math.ceil(n / max(1, cfg.prefill.count)) * kv[s.input_tokens] * HEADROOM
            ),
            "decode_bytes": math.ceil(
                math.ceil(n / max(1, cfg.decode.count))
                * kv[s.input_tokens + s.output_tokens] * HEADROOM
            ),
        })  # fmt: skip
    worst_store = max(r["store_bytes"] for r in rows)
    worst_decode = max(r["decode_bytes"] for r in rows)
    explicit = {item.split("=", 1)[0] for item in pb.target.deploy_set}
    budgets = {
        STORE_KEY: _budget(STORE_KEY, cfg.kv.store_budget_bytes, worst_store, explicit),
        DECODE_KEY: _budget(DECODE_KEY, cfg.decode.kv_budget_bytes, worst_decode, explicit),
    }
    total = worst_store * cfg.prefill.count + worst_decode * cfg.decode.count
    available = memory_available_bytes()
    out = {
        "rule": f"store: ceil(in_flight / prefill.count) x KV(input) x {HEADROOM}; decode: "
        f"ceil(in_flight / decode.count) x KV(input + output) x {HEADROOM}",
        "steps": rows,
        "budgets": budgets,
        "deploy_set": [f"{k}={b['used']}" for k, b in budgets.items() if b["raised"]],
        "largest_step_bytes": total,
        "memory_available_bytes": available,
    }
    if available is not None and total > MEMORY_SHARE * available:
        worst = max(rows, key=lambda r: r["store_bytes"] + r["decode_bytes"])
        raise KVDoesNotFit(
            f"KV does not fit this machine: step {worst['step']} holds up to {_size(total)} of KV "
            f"(store {_size(worst_store)} x {cfg.prefill.count}, decode {_size(worst_decode)} x "
            f"{cfg.decode.count}) and {MEMORY_SHARE:.0%} of the {_size(available)} available is "
            f"{_size(MEMORY_SHARE * available)}; lower matrix.input_tokens or "
            "matrix.concurrency, or run with --set smoke_scale=true"
        )
    return out


def ttft_budget(pb: Playbook, target: Any) -> list[str]:
    """The deploy's breaker bound follows the TTFT this playbook judges (its share of
    ``router.ttft_budget_ms``) unless the playbook sets the budget or the bound itself."""
    c = pb.criteria
    budget = c.ttft_p99_ms or c.ttft_p50_ms
    keys = {item.split("=", 1)[0].strip() for item in target.deploy_set}
    if budget is None or keys & {"router.ttft_budget_ms", "router.degrade_p99_ms"}:
        return []
    return [f"router.ttft_budget_ms={budget:g}"]


def _budget(key: str, deployed: int, need: int, explicit: set[str]) -> dict[str, Any]:
    """The budget to use: the deploy's, raised to ``need`` unless the playbook set it."""
    raise_it = need > deployed and key not in explicit
    return {
        "deploy": deployed,
        "need": need,
        "used": need if raise_it else deployed,
        "raised": raise_it,
        "short": need > deployed and not raise_it,  # the playbook's own value is below the need
    }


def _size(nbytes: float) -> str:
    return human_bytes(nbytes)


def sizing_lines(sizing: dict[str, Any]) -> list[str]:
    """The pre-flight's words on it: what each budget is, and why."""
    lines = []
    for key, b in sizing["budgets"].items():
        if b["raised"]:
            why = f"raised from the deploy's {_size(b['deploy'])} to the largest step's need"
        elif b["short"]:
            why = (f"the playbook's own {_size(b['deploy'])}, below the largest step's need "
                   f"{_size(b['need'])}: those steps' requests wait for room")  # fmt: skip
        else:
            why = f"the deploy's, which holds the largest step's need {_size(b['need'])}"
        lines.append(f"{key} {b['used']:,} B ({_size(b['used'])}): {why}")
    avail = sizing["memory_available_bytes"]
    lines.append(
        f"largest step's KV {_size(sizing['largest_step_bytes'])} of "
        f"{_size(avail) if avail is not None else 'unknown'} available memory"
    )
    return lines
