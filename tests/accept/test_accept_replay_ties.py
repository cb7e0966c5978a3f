"""The output-mismatch replay's near-ties (``judgement.replay_tie_logprob``), against a real
HTTP server on 127.0.0.1 that answers each replay with chosen token ids and logprobs.

The server stands in for a gateway whose engine's kernels depend on the batch (vLLM in bf16):
what it answers is set per prompt, so each way a replay can differ is provoked exactly. The
gateway's own ``return_tokens_as_token_ids`` is tested against a real deployment in
tests/serving/test_openai_sdk.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from local_app import serving

from pdx.accept.judge.gates import replay

SHIPPED = [5, 6, 7, 8]
# prompt id -> (the replay's tokens, {position: {alternative: logprob}}); the replay's chosen
# token at a position has logprob -0.5 unless listed.
ANSWERS: dict[int, tuple[list[int], dict[int, dict[int, float]]]] = {
    1: ([5, 6, 7, 8], {}),  # the same tokens: a match
    2: ([5, 6, 9, 10], {2: {9: -0.50, 7: -0.52}}),  # 0.02 nat apart: a near-tie
    3: ([5, 11, 12, 13], {1: {11: -0.50, 6: -1.00}}),  # 0.5 nat apart: a mismatch
    4: ([14, 15, 16, 17], {0: {14: -0.50, 3: -2.0}}),  # shipped token not offered: a mismatch
    # logprobs that rank the shipped token above the replay's own choice do not show how the
    # choice was made (a penalty, another distribution): not a tie
    5: ([5, 18, 19, 20], {1: {18: -0.50, 6: -0.49}}),
}


def _logprobs(tokens: list[int], tops: dict[int, dict[int, float]]) -> dict[str, Any]:
    top = [{f"token_id:{t}": v for t, v in tops.get(i, {tok: -0.5}).items()}
           for i, tok in enumerate(tokens)]  # fmt: skip
    return {"tokens": [f"token_id:{t}" for t in tokens],
            "token_logprobs": [tops.get(i, {}).get(t, -0.5) for i, t in enumerate(tokens)],
            "top_logprobs": top, "text_offset": list(range(len(tokens)))}  # fmt: skip


@pytest.fixture
async def server() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    flight = {"now": 0, "most": 0}

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        flight["now"] += 1
        flight["most"] = max(flight["most"], flight["now"])
        await asyncio.sleep(0.05)  # long enough for replays sent at once to overlap
        flight["now"] -= 1
        body["_in_flight_most"] = flight["most"]
        tokens, tops = ANSWERS[body["prompt"][0]]
        choice: dict[str, Any] = {"index": 0, "text": "", "token_ids": tokens,
                                  "finish_reason": "length"}  # fmt: skip
        if body.get("logprobs"):
            choice["logprobs"] = _logprobs(tokens, tops)
        return web.json_response({"choices": [choice]})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url:
        yield url, seen


def _candidates() -> list[dict[str, Any]]:
    return [{"ok": True, "prompt_ids": [p, 40, 41], "output_ids": SHIPPED,
             "output_len_requested": len(SHIPPED),
             "pdx": {"route": "disaggregated", "kv_id": f"kv-{p}"}} for p in ANSWERS]  # fmt: skip


async def test_a_near_tie_is_shown_and_not_counted_a_farther_difference_is(server: Any) -> None:
    url, seen = server
    got = await replay(url, _candidates(), {}, "", 10.0, tie_logprob=0.06, concurrency=2)
    assert (got["replayed"], got["replay_mismatches"], got["replay_errors"]) == (5, 3, 0)
    assert got["replay_near_ties"] == 1 and got["replay_tie_logprob"] == 0.06
    (tie,) = got["replay_near_tie_examples"]
    assert tie["kv_id"] == "kv-2" and tie["first_difference_at_token"] == 2
    assert tie["logprob_gap"] == pytest.approx(0.02)
    by_kv = {m["kv_id"]: m for m in got["replay_mismatch_examples"]}
    assert by_kv["kv-3"]["logprob_gap"] == pytest.approx(0.5)  # too far apart for a tie
    assert by_kv["kv-4"]["logprob_gap"] is None  # the shipped token was not among the top
    assert by_kv["kv-5"]["logprob_gap"] == pytest.approx(-0.01)  # ranked above the choice
    # the replay asked for the logprobs it needs, by token id, on the local route
    assert all(b["logprobs"] == 5 and b["return_tokens_as_token_ids"] for b in seen)
    assert all(b["pdx_route"] == "local" and b["temperature"] == 0 for b in seen)
    assert max(b["_in_flight_most"] for b in seen) == 2  # judgement.replay_concurrency


async def test_without_a_tie_tolerance_every_difference_is_a_mismatch(server: Any) -> None:
    url, seen = server
    got = await replay(url, _candidates(), {}, "", 10.0)
    assert (got["replayed"], got["replay_mismatches"]) == (5, 4)
    assert "replay_near_ties" not in got
    assert not any("logprobs" in b for b in seen)  # nothing asked beyond the tokens
    assert max(b["_in_flight_most"] for b in seen) == 1  # one at a time unless asked
