"""The engines' own Prometheus series, read and merged into the gateway's ``/metrics``.

Every vLLM instance exports the same names (``vllm:nixl_bytes_transferred``,
``vllm:prompt_tokens_cached_by_source{source="p2p"}``, ...). The gateway fetches each one's
text, parses it with prometheus_client's parser and re-exposes every sample with one more
label, ``pdx_instance`` (``prefill-0``, ``decode-1``), after its own series: one scrape
shows pdx's view and each engine's, and no two instances' samples collide.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

INSTANCE_LABEL = "pdx_instance"


def parse(text: str) -> list[Metric]:
    """The metric families of one exposition (unparseable text gives none)."""
    try:
        return list(text_string_to_metric_families(text))
    except ValueError:
        return []


class _Merged:
    """A collector yielding the families of several instances, relabelled."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def merge(instances: Iterable[tuple[str, str]]) -> bytes:
    """Expositions of named instances as one, each sample labelled with its instance."""
    merged: dict[str, Metric] = {}
    for name, text in instances:
        for family in parse(text):
            key = family.name
            if key not in merged:
                merged[key] = Metric(family.name, family.documentation, family.type, family.unit)
            if merged[key].type != family.type:  # two instances disagree: keep the first kind
                continue
            for s in family.samples:
                labels = {**s.labels, INSTANCE_LABEL: name}
                merged[key].samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))  # type: ignore[arg-type]
    return generate_latest(registry)


def sample_lines(text: str, *names: str) -> str:
    """Only the sample lines that may belong to ``names`` (each a name's prefix match; comments
    and every other series dropped). Parsed alone they give the same samples, untyped: what
    reading a few series needs. A vLLM exposition is ~700 lines of histograms; parsing all of
    it took ~9 ms of the gateway's event loop per series read, three reads every 2 s."""
    return "".join(line + "\n" for line in text.splitlines() if line.startswith(names))


def sample_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 when none)."""
    total = 0.0
    for family in parse(sample_lines(text, name)):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += float(s.value)
    return total


# The KV-path counters of one instance: key → (sample name, labels it must carry).
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "p2p_cached_tokens": ("vllm:prompt_tokens_cached_by_source_total", {"source": "p2p"}),
    "device_cached_tokens": ("vllm:prompt_tokens_cached_by_source_total", {"source": "device"}),
    "external_prefix_cache_hits": ("vllm:external_prefix_cache_hits_total", {}),
    "nixl_bytes_transferred": ("vllm:nixl_bytes_transferred_sum", {}),
    "nixl_transfers": ("vllm:nixl_bytes_transferred_count", {}),
    "nixl_xfer_time_s": ("vllm:nixl_xfer_time_seconds_sum", {}),
    "nixl_failed_transfers": ("vllm:nixl_num_failed_transfers_total", {}),
    "prompt_tokens": ("vllm:prompt_tokens_total", {}),
    "requests_running": ("vllm:num_requests_running", {}),
    "requests_waiting": ("vllm:num_requests_waiting", {}),
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", {}),
}


def engine_counters(text: str) -> dict[str, Any]:
    """The KV-path counters of one instance that tests, benchmarks and reports read (the text
    cut to their lines once, then each summed from those)."""
    kept = sample_lines(text, *{name for name, _ in COUNTERS.values()})
    return {key: sample_sum(kept, name, **labels) for key, (name, labels) in COUNTERS.items()}
