"""Prometheus metrics from the target: scrape, parse, and take differences between snapshots.

Parsing uses prometheus_client's text parser. A snapshot keeps pdx's own series (``pdx_``) and
the engines' series the gateway re-exposes (``vllm:``, labelled with ``pdx_instance``); it maps
``name{label="v",...}`` to a float; counter families keep their ``_total`` sample names,
histograms their ``_bucket``/``_sum``/``_count``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Snapshot:
    """Every pdx and engine sample from one scrape, with the wall time it was taken."""

    t_s: float
    samples: dict[str, float] = field(default_factory=dict)
    error: str | None = None

    def total(self, name: str, **labels: str) -> float:
        """Sum of every sample called ``name`` whose labels include ``labels``."""
        out = 0.0
        for key, value in self.samples.items():
            sample_name, sample_labels = split_key(key)
            if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items()):
                out += value
        return out

    def names(self) -> set[str]:
        """Distinct sample names."""
        return {split_key(k)[0] for k in self.samples}


def sample_key(name: str, labels: dict[str, str]) -> str:
    """``name{a="1",b="2"}`` with labels sorted (stable across scrapes)."""
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def split_key(key: str) -> tuple[str, dict[str, str]]:
    """Inverse of :func:`sample_key` (label values never contain ``",``)."""
    name, _, rest = key.partition("{")
    labels: dict[str, str] = {}
    for part in rest.rstrip("}").split('",'):
        if "=" in part:
            k, _, v = part.partition("=")
            labels[k] = v.strip('"')
    return name, labels


# pdx's series, and vLLM's as the gateway of an engine: vllm deploy merges them in.
TARGET_PREFIXES = ("pdx_", "vllm:")


def parse_metrics(
    text: str, *, prefix: str | tuple[str, ...] = TARGET_PREFIXES
) -> dict[str, float]:
    """Samples whose name starts with ``prefix`` (one or several) from Prometheus text."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix) and not s.name.endswith("_created"):
                out[sample_key(s.name, dict(s.labels))] = float(s.value)
    return out


def delta(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """``after − before`` per sample (counters and histogram parts); gauges keep ``after``."""
    out: dict[str, float] = {}
    for key, value in after.samples.items():
        name = split_key(key)[0]
        if name.endswith(("_total", "_count", "_sum", "_bucket", "_created")):
            out[key] = value - before.samples.get(key, 0.0)
        else:
            out[key] = value
    return out


async def scrape(url: str, *, timeout_s: float = 5.0) -> Snapshot:
    """GET ``url`` and parse it; a failed scrape is returned with its error, never raised."""
    import aiohttp

    t = time.time()
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as resp:
            text = await resp.text()
            if resp.status != 200:
                return Snapshot(t, error=f"HTTP {resp.status}")
        return Snapshot(t, parse_metrics(text))
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return Snapshot(t, error=f"{type(exc).__name__}: {exc}")
