"""An "instant" vLLM stand-in: just enough of vLLM's OpenAI API for the P/D two-step protocol.

It computes nothing and answers at once, so a front in front of it measures only itself:

- ``GET /health`` (200), ``GET /metrics`` (idle ``vllm:*`` gauges), ``GET /v1/models``;
- ``POST /v1/completions`` with ``kv_transfer_params.do_remote_decode``: prefill's answer, a
  non-streamed completion of one token with ``kv_transfer_params`` naming the prompt's KV
  blocks (``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``, ...), as vLLM's
  NixlConnector returns them;
- any other ``POST /v1/completions``: decode, ``max_tokens`` tokens streamed as vLLM streams
  them (one SSE event per token, ``token_ids``/``prompt_token_ids`` with ``return_token_ids``,
  the usage event with ``stream_options.include_usage``, ``data: [DONE]``), with no delay;
- ``GET /stats``: counters (prefills, decodes given KV this engine id handed out, decodes
  without KV, unknown paths), so a benchmark can check that a front ran both steps.

    python benchmarks/instant_engine.py --role prefill [--port 0] [--model instant]

prints ``PORT <n>`` once it listens; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import uuid
from typing import Any

from aiohttp import web

BLOCK_SIZE = 16  # tokens per KV block, as vLLM's default
TEXT = "the quick brown fox jumps over the lazy dog, "
OFFSET = 4  # ByteTokenizer's ids: 4 + byte
PREFILL_ENGINE_ID = "instant-prefill"


def token_of(i: int) -> tuple[int, str]:
    """The i-th generated token: its id (a byte-level id) and its text."""
    ch = TEXT[i % len(TEXT)]
    return OFFSET + ord(ch), ch


class InstantEngine:
    """One instant instance; prefill and decode answer alike, by request."""

    def __init__(self, model: str, engine_id: str, side_port: int) -> None:
        self.model, self.engine_id, self.side_port = model, engine_id, side_port
        self.created = int(time.time())
        self.stats = {"prefill": 0, "decode_kv": 0, "decode_kv_foreign": 0, "decode_plain": 0,
                      "unknown_path": 0}  # fmt: skip
        self._choices: dict[tuple[int, int, bool], str] = {}  # (i, n, ids) → event's choice

    def _choice(self, i: int, n: int, with_ids: bool) -> str:
        """Token i of n as a streamed choice (JSON), ``prompt_token_ids`` null."""
        key = (i, n, with_ids)
        if key not in self._choices:
            tid, text = token_of(i)
            choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                      "finish_reason": "length" if i == n - 1 else None,
                                      "stop_reason": None}  # fmt: skip
            if with_ids:
                choice |= {"prompt_token_ids": None, "token_ids": [tid]}
            self._choices[key] = json.dumps(choice, separators=(",", ":"))
        return self._choices[key]

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/stats", self.get_stats)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_route("*", "/{tail:.*}", self.unknown)
        return app

    async def health(self, request: web.Request) -> web.Response:
        """200, empty."""
        return web.Response()

    async def metrics(self, request: web.Request) -> web.Response:
        """Idle gauges in Prometheus text."""
        labels = f'{{engine="0",model_name="{self.model}"}}'
        text = "".join(
            f"# TYPE vllm:{name} gauge\nvllm:{name}{labels} 0.0\n"
            for name in ("kv_cache_usage_perc", "num_requests_waiting", "num_requests_running")
        )
        return web.Response(text=text, content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        """The one served model."""
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "vllm",
                "root": self.model, "parent": None, "max_model_len": 4096}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def get_stats(self, request: web.Request) -> web.Response:
        """The request counters."""
        return web.json_response(self.stats)

    async def unknown(self, request: web.Request) -> web.Response:
        """404 for any other path (counted)."""
        self.stats["unknown_path"] += 1
        return web.json_response({"error": {"message": f"no route {request.path}"}}, status=404)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """Prefill (``do_remote_decode``) or decode, by the request's ``kv_transfer_params``."""
        body = json.loads(await request.read())
        prompt = body.get("prompt") or []
        if prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not isinstance(prompt, list):  # text: one id per byte, as the byte tokenizer
            prompt = [OFFSET + b for b in str(prompt).encode()]
        rid = str(body.get("request_id") or request.headers.get("X-Request-Id") or uuid.uuid4())
        with_ids = bool(body.get("return_token_ids"))
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            self.stats["prefill"] += 1
            return web.json_response(self._whole(prompt, rid, 1, with_ids, self._kv(prompt, rid)))
        if params.get("do_remote_prefill"):
            known = params.get("remote_engine_id") == PREFILL_ENGINE_ID
            self.stats["decode_kv" if known else "decode_kv_foreign"] += 1
        else:
            self.stats["decode_plain"] += 1
        n = max(1, int(body.get("max_tokens") or 16))
        if not body.get("stream"):
            return web.json_response(self._whole(prompt, rid, n, with_ids, None))
        return await self._stream(request, body, prompt, rid, n, with_ids)

    def _kv(self, prompt: list[int], rid: str) -> dict[str, Any]:
        """What NixlConnector's prefill side returns: where the prompt's blocks wait."""
        blocks = list(range((len(prompt) + BLOCK_SIZE - 1) // BLOCK_SIZE))
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [blocks],
            "remote_engine_id": self.engine_id, "remote_request_id": rid,
            "remote_host": "127.0.0.1", "remote_port": self.side_port, "tp_size": 1,
            "dcp_size": 1, "pp_size": 1, "remote_num_tokens": len(prompt),
            "remote_blocks_expiry_time": None, "transfer_mode": "pull",
        }  # fmt: skip

    def _whole(
        self, prompt: list[int], rid: str, n: int, with_ids: bool, kv: dict[str, Any] | None
    ) -> dict[str, Any]:
        """A non-streamed completion of n tokens."""
        ids = [token_of(i)[0] for i in range(n)]
        choice = {"index": 0, "text": "".join(token_of(i)[1] for i in range(n)),
                  "logprobs": None, "finish_reason": "length", "stop_reason": None,
                  "prompt_logprobs": None, "prompt_token_ids": prompt if with_ids else None,
                  "token_ids": ids if with_ids else None}  # fmt: skip
        usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n,
                 "completion_tokens": n}  # fmt: skip
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [choice], "usage": usage,
                "kv_transfer_params": kv}  # fmt: skip

    async def _stream(
        self, request: web.Request, body: dict[str, Any], prompt: list[int], rid: str, n: int,
        with_ids: bool,
    ) -> web.StreamResponse:  # fmt: skip
        """One event per token (each its own write, as vLLM sends them), usage, [DONE]."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = f'data: {{"id":"cmpl-{rid}","object":"text_completion","created":{self.created},'
        head += f'"model":"{self.model}","choices":['
        for i in range(n):
            choice = self._choice(i, n, with_ids)
            if i == 0 and with_ids:  # vLLM sends the prompt's ids once, with the first token
                ids = json.dumps(prompt, separators=(",", ":"))
                choice = choice.replace('"prompt_token_ids":null', f'"prompt_token_ids":{ids}')
            await resp.write(f"{head}{choice}]}}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = f'"prompt_tokens":{len(prompt)},"total_tokens":{len(prompt) + n},'
            usage += f'"completion_tokens":{n}'
            await resp.write(f'{head}],"usage":{{{usage}}}}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def serve(role: str, port: int, model: str) -> None:
    """Listen on 127.0.0.1:port (0 = ephemeral), print the port, run until SIGTERM."""
    engine = InstantEngine(model, f"instant-{role}", side_port=5600)
    runner = web.AppRunner(engine.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    server = site._server
    assert server is not None and server.sockets  # type: ignore[attr-defined]
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)  # type: ignore[attr-defined]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    """Parse the flags and serve."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--model", default="instant")
    args = ap.parse_args()
    asyncio.run(serve(args.role, args.port, args.model))


if __name__ == "__main__":
    main()
