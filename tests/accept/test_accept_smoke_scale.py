"""smoke_scale (every cell, briefly) and the pre-flight's KV sizing (budgets, fit)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdx.accept.playbook import load_playbook
from pdx.accept.preflight import budget
from pdx.accept.preflight.budget import KVDoesNotFit, size_kv, sizing_lines
from pdx.accept.steps import expand_steps

PLAYBOOKS = Path(__file__).resolve().parents[2] / "playbooks"
REFERENCE = PLAYBOOKS / "cross-dc-reference.yaml"
PER_TOKEN = 327_680  # llama-3.1-70b, bf16 (the reference's synthetic model)


def test_smoke_scale_keeps_every_cell_and_shrinks_each() -> None:
    full = load_playbook(REFERENCE)
    pb = load_playbook(REFERENCE, dotted=["smoke_scale=true"])
    assert len(expand_steps(pb)) == len(expand_steps(full)) == 216
    m = pb.matrix
    assert (m.input_tokens, m.output_tokens, m.concurrency) == (
        [32, 256, 1024], [8, 32, 64], [1, 3, 6, 8]
    )  # fmt: skip
    assert m.duration_s == 8 and all(s.duration_s <= 8 for s in expand_steps(pb))
    cut = pb.conditions["link-break"]
    assert cut.link_down_at_s == pytest.approx(240 * 8 / 600) and cut.link_down_for_s == 1.0
    assert pb.conditions["idle-60"].idle_s == 5 and pb.conditions["idle-5"].idle_s == 5
    assert pb.validity.min_requests == 3 and pb.validity.min_duration_s == 4
    assert pb.judgement.replay_requests == 5 and pb.load.workers == 0
    assert pb.target.deploy_set[0] == "model.synthetic_time_scale=0.03125"
    # the full matrix ships prompts of 512 tokens and more: the scaled one, 16 and more
    assert "router.local_prefill_max_tokens=16" in pb.target.deploy_set
    assert pb.criteria == full.criteria  # thresholds untouched: the samples say what they prove
    own = load_playbook(
        REFERENCE, dotted=["smoke_scale=true", "target.deploy_set=[model.synthetic_time_scale=1]"]
    )
    assert own.target.deploy_set[-1] == "model.synthetic_time_scale=1"  # the playbook's wins


def test_kv_that_does_not_fit_stops_the_run_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(budget, "memory_available_bytes", lambda: 24 * 2**30)
    pb = load_playbook(REFERENCE)
    with pytest.raises(KVDoesNotFit) as err:
        size_kv(pb, PLAYBOOKS, expand_steps(pb))
    # 64 users x 32,768 tokens: the store holds 64 x 10 GiB x 1.25 = 800 GiB on its own
    assert "step s35-in32768-out512-c64-normal holds up to 1.6 TiB of KV" in str(err.value)
    assert "smoke_scale=true" in str(err.value)


def test_budgets_are_raised_to_the_largest_steps_need_unless_the_playbook_set_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(budget, "memory_available_bytes", lambda: 24 * 2**30)
    pb = load_playbook(REFERENCE, dotted=["smoke_scale=true"])
    sizing = size_kv(pb, PLAYBOOKS, expand_steps(pb))
    assert sizing is not None
    store, decode = sizing["budgets"].values()
    assert store["need"] == int(8 * 1024 * PER_TOKEN * 1.25)  # 8 users, 1024-token prompts
    assert decode["need"] == int(8 * (1024 + 64) * PER_TOKEN * 1.25)
    assert store["raised"] and decode["raised"] and store["used"] == store["need"]
    assert sizing["deploy_set"] == [
        f"kv.store_budget_bytes={store['need']}",
        f"decode.kv_budget_bytes={decode['need']}",
    ]
    own = load_playbook(
        REFERENCE,
        dotted=[
            "smoke_scale=true",
            "target.deploy_set=[model.backend=synthetic, model.preset=llama-3.1-70b, "
            "decode.kv_budget_bytes=1000000000]",
        ],
    )
    kept = size_kv(own, PLAYBOOKS, expand_steps(own))
    assert kept is not None
    assert kept["budgets"]["decode.kv_budget_bytes"]["short"] and kept["deploy_set"] == [
        f"kv.store_budget_bytes={store['need']}"
    ]
    assert "below the largest step's need" in sizing_lines(kept)[1]


def test_no_sizing_where_pdx_does_not_deploy_its_own_pair() -> None:
    pb = load_playbook(PLAYBOOKS / "external-endpoint.yaml")
    assert size_kv(pb, PLAYBOOKS, expand_steps(pb)) is None
