"""Request traces, read once for every part of pdx that replays them (the load generator,
``pdx accept``, ``pdx simulate``, ``pdx trace``).

``formats`` (Mooncake JSONL, BurstGPT CSV, pdx JSONL → one :class:`~pdx.traces.formats.Trace`),
``prompts`` (token ids that share exactly the blocks the trace says they share), ``stats``
(load, lengths, sessions, the prefix a cache could serve), ``schedule`` (a window of it, in
time, scaled), ``synth`` (traces pdx makes itself, with a known reuse).
Standard library, numpy and orjson only: Locust's process imports it.
"""

__all__ = ["formats", "prompts", "schedule", "stats", "synth"]
