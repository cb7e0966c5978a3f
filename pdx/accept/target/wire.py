"""Proof on the wire: does a request's content cross the sites in the clear?

After each step's load, with the step's conditions still on the router hop, pdx captures the
hop (:mod:`pdx.faults.wire` in the router namespace, on its prefill-side interface: every byte
between the sites) while it sends ``requests`` canary requests on the disaggregated route: a
prompt made of one fixed run of token ids, repeated. The capture looks for that run as it
would travel in the clear: packed protobuf varints (pdx's Prefill call) and the JSON array
text (vLLM's prefill call). Each payload-carrying packet is one capture; the gate
``plaintext_on_link_max`` judges the share of captures that held the canary (threshold 0:
none may). Only counts are kept.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from dataclasses import dataclass, field
from typing import Any

CANARY_TOKENS = 12  # one run of the canary (a pattern of 12-24 bytes)
TOKEN_LOW = 4  # below it: special tokens of the tiny models


def canary_ids(seed: int, token_id_max: int) -> list[int]:
    """The run of token ids every canary prompt repeats."""
    rng = random.Random(f"pdx-canary-{seed}")
    return [rng.randint(TOKEN_LOW, max(TOKEN_LOW + 1, token_id_max)) for _ in range(CANARY_TOKENS)]


def varints(ids: list[int]) -> bytes:
    """``ids`` as protobuf packs a repeated int32 field's values."""
    out = bytearray()
    for v in ids:
        v &= (1 << 64) - 1
        while True:
            byte, v = v & 0x7F, v >> 7
            out.append(byte | (0x80 if v else 0))
            if not v:
                break
    return bytes(out)


def patterns(ids: list[int]) -> list[bytes]:
    """How the canary's run looks in the clear: protobuf varints, and JSON array text."""
    return [varints(ids), ",".join(map(str, ids)).encode()]


@dataclass
class WireCheck:
    """The canary requests and the capture of one step (see the module's docstring)."""

    router_ns: str
    iface: str = "eth-prefill"
    requests: int = 20
    token_id_max: int = 255
    seed: int = 0
    extra_body: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    timeout_s: float = 60.0

    async def check(self, url: str, input_tokens: int) -> dict[str, Any]:
        """Capture the hop while the canary requests run; the step's wire facts."""
        ids = canary_ids(self.seed, self.token_id_max)
        prompt = (ids * (max(input_tokens, len(ids)) // len(ids) + 1))[
            : max(input_tokens, 2 * len(ids))
        ]
        cmd = ["ip", "netns", "exec", self.router_ns, sys.executable, "-m", "pdx.faults.wire",
               "--iface", self.iface, "--seconds", str(self.timeout_s * 2)]  # fmt: skip
        for p in patterns(ids):
            cmd += ["--pattern", p.hex()]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdin is not None and proc.stdout is not None
        try:
            first = await asyncio.wait_for(proc.stdout.readline(), 10)
            if first.strip() != b"ready":
                return {
                    "wire_error": _error(first, await proc.stderr.read() if proc.stderr else b"")
                }
            sent = await self._canaries(url, prompt)
            proc.stdin.close()
            last = await asyncio.wait_for(proc.stdout.readline(), 10)
            await asyncio.wait_for(proc.wait(), 10)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        got = json.loads(last)
        if "error" in got:
            return {"wire_error": str(got["error"])}
        n, k = int(got["captures"]), int(got["hits"])
        return {"wire_captures": n, "plaintext_captures": k,
                "plaintext_rate": k / n if n else None, "wire_payload_bytes": got["payload_bytes"],
                "wire_canary_requests": sent, "wire_seconds": got["seconds"],
                "wire_iface": f"{self.router_ns}/{self.iface}"}  # fmt: skip

    async def _canaries(self, url: str, prompt: list[int]) -> int:
        """Send the canary requests one after another, all within ``timeout_s``; how many
        were answered 200."""
        import aiohttp

        body = {
            **self.extra_body,
            "prompt": prompt,
            "max_tokens": 2,
            "pdx_route": "disaggregated",
            **({"model": self.model} if self.model else {}),
        }
        ok = 0
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as s, asyncio.timeout(self.timeout_s):
                for _ in range(self.requests):
                    try:
                        async with s.post(url + "/v1/completions", json=body) as r:
                            await r.read()
                            ok += r.status == 200
                    except aiohttp.ClientError:
                        pass
        except TimeoutError:
            pass  # the capture still counts what crossed until now
        return ok


def _error(first: bytes, err: bytes) -> str:
    try:
        return str(json.loads(first)["error"])
    except (ValueError, KeyError, TypeError):
        return (first + err).decode(errors="replace").strip()[-300:] or "the capture did not start"
