"""The OpenAI side of the gateway: request parsing, error shape, usage.

Everything a client sends is checked here and turned into a :class:`CompletionRequest`;
anything wrong is an :class:`HTTPProblem`, answered once in :func:`http_error`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from pdx.kv.codecs import is_codec_name, valid_codec_names
from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.router import ROUTES

# OpenAI request fields pdx does not implement: refused unless left at their default, so a
# client never silently gets something other than what it asked for.
UNSUPPORTED: dict[str, Any] = {"n": 1, "best_of": 1, "stop": [], "logprobs": None, "echo": False,
                               "suffix": None}  # fmt: skip


class HTTPProblem(Exception):
    """A request the gateway answers with an error status and a one-line message."""

    def __init__(self, status: int, message: str, kind: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.headers = headers or {}


def http_error(exc: HTTPProblem) -> web.Response:
    """The JSON error response for ``exc``."""
    body = {"error": {"message": exc.message, "type": exc.kind, "code": exc.status}}
    return web.json_response(body, status=exc.status, headers=exc.headers)


@dataclass
class CompletionRequest:
    """A validated completion request."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int
    stream: bool
    return_token_ids: bool
    route: str
    user: str | None
    ignore_eos: bool
    model: str
    kv_codec: str


def body_field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """``body[name]`` checked to be of ``kind`` (None or absent: ``default``)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise HTTPProblem(400, f"{name}: got {value!r}, expected a number", "invalid_request_error")
    if not isinstance(value, kind):
        raise HTTPProblem(
            400, f"{name}: got {value!r}, expected {kind_name(kind)}", "invalid_request_error"
        )
    return value


def kind_name(kind: type | tuple[type, ...]) -> str:
    """``int or float``: how an expected type reads in an error message."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def prompt_ids(tokenizer: Tokenizer, prompt: Any) -> list[int]:
    """Token ids of ``prompt`` (a string, a list of ids, or a one-element list of either)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return list(prompt)
    raise HTTPProblem(
        400,
        f"prompt: got {prompt!r:.60}, expected a non-empty string or list of token ids",
        "invalid_request_error",
    )


def parse_completion(
    body: dict[str, Any],
    ids: list[int],
    *,
    default_max_tokens: int,
    max_context_tokens: int,
    model_name: str,
) -> CompletionRequest:
    """Validate the sampling and pdx fields of a completion request."""
    bad = "invalid_request_error"
    for name, default in UNSUPPORTED.items():
        if body.get(name) not in (None, default):
            raise HTTPProblem(
                400, f"{name}: got {body[name]!r}, only {default!r} is supported", bad
            )
    max_tokens = body_field(body, "max_tokens", int, default_max_tokens)
    if max_tokens < 1:
        raise HTTPProblem(400, f"max_tokens: got {max_tokens}, expected >= 1", bad)
    temperature = float(body_field(body, "temperature", (int, float), 0.0))
    if temperature < 0:
        raise HTTPProblem(400, f"temperature: got {temperature}, expected >= 0", bad)
    route = body_field(body, "pdx_route", str, "auto")
    if route not in ROUTES:
        raise HTTPProblem(400, f"pdx_route: got {route!r}, expected one of {ROUTES}", bad)
    kv_codec = body_field(body, "pdx_kv_codec", str, "")
    if kv_codec and not is_codec_name(kv_codec):
        raise HTTPProblem(
            400, f"pdx_kv_codec: got {kv_codec!r}, expected one of {valid_codec_names()}", bad
        )
    if len(ids) + max_tokens > max_context_tokens:
        raise HTTPProblem(
            400,
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {max_context_tokens} tokens",
            bad,
        )
    return CompletionRequest(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=temperature,
        seed=body_field(body, "seed", int, 0),
        stream=body_field(body, "stream", bool, False),
        return_token_ids=body_field(body, "return_token_ids", bool, False),
        route=route,
        user=body_field(body, "user", str, None),
        ignore_eos=body_field(body, "ignore_eos", bool, False),
        model=body_field(body, "model", str, model_name),
        kv_codec=kv_codec,
    )


def usage(req: CompletionRequest, completion_tokens: int) -> dict[str, int]:
    """The OpenAI ``usage`` object."""
    return {
        "prompt_tokens": len(req.prompt_ids),
        "completion_tokens": completion_tokens,
        "total_tokens": len(req.prompt_ids) + completion_tokens,
    }
