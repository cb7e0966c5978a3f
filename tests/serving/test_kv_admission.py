"""The gateway and decode agree on a request's KV reservation: a request no decode budget can
ever hold is a 400 naming both sizes; one that fits waits or goes where there is room."""

from __future__ import annotations

import aiohttp
from inprocess_pair import inprocess_pair

from pdx.serving.backends import create_backend
from pdx.serving.deploy_config import load_deploy_config

PER_TOKEN = create_backend(load_deploy_config().model).kv_bytes_bound(1)[0]


async def test_a_request_no_budget_can_hold_is_a_400_and_one_that_fits_is_served() -> None:
    sets = [f"decode.kv_budget_bytes={PER_TOKEN * 64}"]
    async with inprocess_pair(sets) as (gw, _prefill, _decode):
        await gw.poll_once()
        url = f"http://127.0.0.1:{gw.port}/v1/completions"
        prompt = list(range(10, 30))  # 20 tokens
        async with aiohttp.ClientSession() as s:
            body = {"prompt": prompt, "max_tokens": 50, "pdx_route": "local"}
            async with s.post(url, json=body) as r:
                assert r.status == 400
                err = (await r.json())["error"]
            body["max_tokens"] = 40  # 60 of 64 tokens: fits
            async with s.post(url, json=body) as r:
                assert r.status == 200, await r.text()
    assert err["code"] == "kv_budget_exceeded" and err["param"] == "max_tokens"
    assert err["message"].startswith(
        f"the request's KV needs {70 * PER_TOKEN} bytes (prompt 20 + max_tokens 50 tokens): "
        f"more than any decode instance's whole KV budget (decode.kv_budget_bytes, largest "
        f"{64 * PER_TOKEN})"
    )
