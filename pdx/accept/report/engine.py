"""What a vLLM pair itself reported during each step: the ``vllm:`` series the gateway
re-exposes per instance (``pdx_instance``), taken from the step's ``metrics_delta``, and TCP's
own view of the KV connection between the sites (``kernel.tcp``, target.netns runs)."""

from __future__ import annotations

from pdx.accept.load.metrics import split_key
from pdx.accept.report.schema import Report, StepReport
from pdx.accept.target.netns import MIN_RTT_WINDOW_S

ENGINE_HEADERS = ["step", "NIXL pulls", "NIXL bytes", "NIXL time / pull", "failed pulls",
                  "KV expired", "p2p cached tokens", "device cached tokens", "preemptions",
                  "prefill KV usage after", "TCP RTT on the KV connection"]  # fmt: skip


def _total(delta: dict[str, float], name: str, role: str, **labels: str) -> float | None:
    found, total = False, 0.0
    for key, value in delta.items():
        sample, have = split_key(key)
        if sample != name or not have.get("pdx_instance", "").startswith(role):
            continue
        if all(have.get(k) == v for k, v in labels.items()):
            found, total = True, total + value
    return total if found else None


def _n(value: float | None, fmt: str = ",.0f") -> str:
    return "–" if value is None else format(value, fmt)


def engine_row(s: StepReport) -> list[str] | None:
    """One step's row, or None when the step has no vLLM series."""
    d = s.metrics_delta or {}
    if not any(k.startswith("vllm:") for k in d):
        return None
    pulls = _total(d, "vllm:nixl_bytes_transferred_count", "decode")
    moved = _total(d, "vllm:nixl_bytes_transferred_sum", "decode")
    xfer_s = _total(d, "vllm:nixl_xfer_time_seconds_sum", "decode")
    per = f"{xfer_s / pulls * 1e3:.1f} ms" if xfer_s is not None and pulls else "–"
    failed = _total(d, "vllm:nixl_num_failed_transfers_total", "decode")
    expired = sum(_total(d, "vllm:nixl_num_kv_expired_reqs_total", r) or 0.0
                  for r in ("prefill", "decode"))  # fmt: skip
    usage = _total(d, "vllm:kv_cache_usage_perc", "prefill")
    tcp = ((s.kernel or {}).get("tcp") or {}).get("kv_sender") or {}
    low = tcp.get("min_rtt_step_ms", tcp.get("min_rtt_ms"))
    rtt = (
        f"{low:.1f} ms min, {tcp['rtt_ms']:.1f} ms smoothed"
        if low is not None and tcp.get("rtt_ms") is not None
        else "–"
    )
    return [
        s.id, _n(pulls), _n(moved), per, _n(failed), _n(expired),
        _n(_total(d, "vllm:prompt_tokens_cached_by_source_total", "decode", source="p2p")),
        _n(_total(d, "vllm:prompt_tokens_cached_by_source_total", "decode", source="device")),
        _n(_total(d, "vllm:num_preemptions_total", "")),
        "–" if usage is None else f"{usage:.1%}", rtt,
    ]  # fmt: skip


def engine_section(report: Report) -> tuple[str, list[str], list[str], list[list[str]]] | None:
    """The section, when any step has vLLM series."""
    rows = [r for r in (engine_row(s) for s in report.steps) if r is not None]
    if not rows:
        return None
    lines = [
        "Counted by the engines themselves during each step (the gateway re-exposes every "
        "instance's vllm: series with pdx_instance): decode's NIXL pulls, the bytes they moved "
        "and vLLM's own transfer time; prompt tokens decode took from the remote side (p2p) or "
        "its own cache (device); prefill's KV usage when the step ended (KV it still held).",
    ]
    if any(((s.kernel or {}).get("tcp") or {}).get("kv_sender") for s in report.steps):
        lines.append(
            "TCP RTT: the kernel's own figures (ss -tin) on the busiest connection from the "
            "prefill site to the decode site during the step (NIXL's UCX connection with "
            f"vLLM): its minimum RTT, the median over the step's {MIN_RTT_WINDOW_S} s windows "
            "in which it moved bytes, and its smoothed RTT when the step ended, which adds the "
            "queueing of each pull's burst at the router's rate."
        )
    return ("What the engines reported", lines, ENGINE_HEADERS, rows)
