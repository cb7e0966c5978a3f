"""Settings the short smoke-pair tests share."""

from __future__ import annotations

# The smoke playbook cut to 10 s steps that judge what 10 s can prove at 95 %: medians and 5 %
# rates (59 requests decide a threshold of 0 at a 5 % bound); the p99s and 1 % rates of the
# full playbook need 299 requests each. The link verdict is left out: on a box shared with
# other jobs the loopback probe's loss figure is noise, and these tests are about the pair.
SHORT_SMOKE = [
    "matrix.network=[normal]",
    "matrix.duration_s=10",
    "judgement.zero_rate_bound=0.05",
    "judgement.replay_requests=60",
    "preflight.measure_kv=false",
    "criteria.ttft_p99_ms=null",
    "criteria.tpot_p99_ms=null",
    "criteria.transfer_p99_ms=null",
    "criteria.transfer_success_min=0.95",
    "criteria.retry_rate_max=0.05",
    "criteria.degrade_rate_max=0.05",
    "criteria.silent_fallback_max=0.05",
    "criteria.link_verdict=null",
]
