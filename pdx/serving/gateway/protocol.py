"""The OpenAI side of the gateway: request and response models, the error shape, usage.

Every request field is defined once, in the pydantic models below (type, range, default,
description); the OpenAPI document (``/openapi.json``) is generated from them. A body that
does not validate is answered by :class:`HTTPProblem` with OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}``, ``param`` naming the field. Checks that
need the served model (context length, vocabulary, model names) run in :func:`resolve`,
which turns a body into the :class:`CompletionRequest` the rest of the gateway works with.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdx.kv.codecs import is_codec_name, valid_codec_names
from pdx.serving.backends.sampling import GREEDY_BELOW
from pdx.serving.backends.tokenizer import Tokenizer
from pdx.serving.offload_config import OffloadChoice

M = TypeVar("M", bound=BaseModel)

MAX_JSON_DEPTH = 16  # deepest body nesting accepted (a chat body needs 5)
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 16  # choices per request (each one is a sequence in a decode batch)

# OpenAI error ``type`` by status: one vocabulary for every route.
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 408: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error"}  # fmt: skip

# Fields OpenAI defines that pdx accepts and ignores because they do not change the output.
IGNORED_FIELDS = ("metadata", "store", "service_tier", "parallel_tool_calls")

# Fields OpenAI defines that pdx refuses unless left at their default (never silently ignored).
UNSUPPORTED: dict[str, str] = {
    "suffix": "insertion (suffix) is not supported",
    "best_of": "best_of other than n is not supported",
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "response_format": "only response_format {'type': 'text'} is supported",
    "modalities": "only text output is supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning models are not served",
    "web_search_options": "web search is not supported",
    "logprobs+echo": "echo with logprobs (prompt logprobs) is not supported",
}


class HTTPProblem(Exception):
    """A request the gateway answers with an error status, in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}

    @property
    def kind(self) -> str:
        """OpenAI's error ``type``: invalid_request_error, rate_limit_error or server_error."""
        return ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else
                               "invalid_request_error")  # fmt: skip

    def body(self) -> dict[str, Any]:
        """``{"error": {...}}``."""
        err = ErrorObject(message=self.message, type=self.kind, param=self.param, code=self.code)
        return {"error": err.model_dump()}


def bad_request(param: str, message: str, code: str = "invalid_value") -> HTTPProblem:
    """A 400 naming ``param``."""
    return HTTPProblem(400, message, code, param=param)


# --- request models ----------------------------------------------------------------------

TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(BaseModel):
    """OpenAI ``stream_options``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = Field(
        False, description="send a last chunk with `choices: []` and the request's `usage`"
    )
    continuous_usage_stats: bool = Field(False, description="(vLLM) usage on every chunk")


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, description="a served model name (GET /v1/models)")
    max_tokens: int | None = Field(
        None, ge=1, lt=2**31, description="tokens to generate (default gateway.default_max_tokens)"
    )
    temperature: Finite | None = Field(
        None, ge=0, le=2, description=f"0 = greedy (the default); else >= {GREEDY_BELOW}"
    )
    top_p: Finite | None = Field(None, gt=0, le=1, description="nucleus sampling mass")
    top_k: int | None = Field(None, ge=-1, lt=2**31, description="-1 or 0 = off (vLLM)")
    min_p: Finite | None = Field(None, ge=0, le=1, description="drop tokens below min_p × best")
    frequency_penalty: Finite | None = Field(None, ge=-2, le=2)
    presence_penalty: Finite | None = Field(None, ge=-2, le=2)
    repetition_penalty: Finite | None = Field(
        None, gt=0, le=2, description="(vLLM) over prompt and output"
    )
    logit_bias: dict[str, Finite] | None = Field(
        None, max_length=1024, description="token id (as a string) → bias in [-100, 100]"
    )
    n: int | None = Field(None, ge=1, le=MAX_N, description="choices to generate")
    seed: int | None = Field(
        None, ge=0, lt=2**64,
        description="reproducible sampling, an unsigned 64-bit integer in [0, 2**64) (the "
        "pair's wire type); absent = random",
    )  # fmt: skip
    stop: str | list[str] | None = Field(
        None, description=f"up to {MAX_STOP} strings; generation ends before the first match"
    )
    stream: bool | None = Field(None, description="server-sent events")
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256, description="sticky routing key")
    ignore_eos: bool | None = Field(None, description="(vLLM) generate exactly max_tokens")
    min_tokens: int | None = Field(
        None, ge=0, lt=2**31, description="(vLLM) EOS and stop strings not before this many"
    )
    return_token_ids: bool | None = Field(None, description="(vLLM) token ids in each choice")
    return_tokens_as_token_ids: bool | None = Field(None, description="(vLLM) token_id:N tokens")
    pdx_route: Literal["auto", "disaggregated", "local"] | None = Field(
        None, description="force a path (default auto)"
    )
    pdx_kv_codec: str | None = Field(None, description="KV codec for this request")
    pdx_offload: OffloadChoice | None = Field(
        None, description="this request's offload policy and threshold (default router.offload)"
    )
    cache_salt: str | None = Field(None, min_length=1, max_length=256, description="prefix-cache "
        "salt: requests with different salts share no cached KV")  # fmt: skip
    # Accepted, no effect on the output (see IGNORED_FIELDS).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _ranges(self) -> SamplingFields:
        if self.temperature is not None and 0 < self.temperature < GREEDY_BELOW:
            raise _FieldProblem("temperature", self.temperature,
                                f"0 (greedy) or a number in [{GREEDY_BELOW}, 2]")  # fmt: skip
        for token, bias in (self.logit_bias or {}).items():
            if not (token.isascii() and token.isdigit()) or int(token) >= 2**31:
                raise _FieldProblem("logit_bias", token, "token ids as decimal strings")
            if not -100 <= bias <= 100:
                raise _FieldProblem(f"logit_bias.{token}", bias, "a number in [-100, 100]")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise _FieldProblem("stop", self.stop, f"up to {MAX_STOP} non-empty strings")
        if self.stream_options is not None and not self.stream:
            raise _FieldProblem("stream_options", "set", "only with stream: true")
        if self.pdx_kv_codec and not is_codec_name(self.pdx_kv_codec):
            raise _FieldProblem("pdx_kv_codec", self.pdx_kv_codec,
                                f"one of {valid_codec_names()}")  # fmt: skip
        return self


class CompletionBody(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]] = Field(
        description="a string or a list of token ids (or a one-element list of either)"
    )
    echo: bool | None = Field(None, description="prepend the prompt to the completion")
    logprobs: int | None = Field(None, ge=0, le=20, description="top alternatives per token")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only equal to n")
    suffix: str | None = Field(None, description="not supported: only null")

    @model_validator(mode="after")
    def _supported(self) -> CompletionBody:
        if self.suffix is not None:
            raise _FieldProblem("suffix", self.suffix, "null", UNSUPPORTED["suffix"])
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise _FieldProblem("best_of", self.best_of, "null or equal to n",
                                UNSUPPORTED["best_of"])  # fmt: skip
        if self.echo and self.logprobs is not None:
            raise _FieldProblem("echo", True, "false when logprobs is set",
                                UNSUPPORTED["logprobs+echo"])  # fmt: skip
        return self


class TextPart(BaseModel):
    """A text content part of a chat message."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message (text content, or a list of text parts)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        """The content as one string: text parts joined by newlines (as vLLM flattens them)."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ResponseFormat(BaseModel):
    """OpenAI ``response_format``: only plain text is served."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]


class ChatCompletionBody(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(
        None, ge=1, lt=2**31, description="tokens to generate (wins over max_tokens)"
    )
    logprobs: bool | None = Field(None, description="logprob of each generated token")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="alternatives per token")
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=0, description="only empty")
    tool_choice: Literal["none"] | None = Field(None, description="only 'none'")
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionBody:
        if self.top_logprobs and not self.logprobs:
            raise _FieldProblem("top_logprobs", self.top_logprobs, "logprobs: true with it")
        return self


class _FieldProblem(ValueError):
    """A cross-field check that failed, naming its field (raised inside validators)."""

    def __init__(self, param: str, value: Any, expected: str, why: str = "") -> None:
        self.param, self.value, self.expected, self.why = param, value, expected, why
        super().__init__(f"{param}: got {value!r:.60}, expected {expected}")


# --- response models ---------------------------------------------------------------------


class ErrorObject(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every non-2xx body."""

    error: ErrorObject


class Usage(BaseModel):
    """Token counts of one request (all choices)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None  # cached_tokens, where the engine says


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class TopLogprob(BaseModel):
    """One alternative token."""

    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprob):
    """One generated token with its alternatives."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat logprobs."""

    content: list[TokenLogprobEntry] | None
    refusal: list[TokenLogprobEntry] | None = None


class CompletionChoice(BaseModel):
    """One completion choice."""

    model_config = ConfigDict(extra="allow")  # token_ids, prompt_token_ids when asked
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None


class AssistantMessage(BaseModel):
    """The generated chat message."""

    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None


class ChatChoice(BaseModel):
    """One chat completion choice."""

    model_config = ConfigDict(extra="allow")
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class CompletionResponse(BaseModel):
    """The body of a non-streaming completion."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None
    pdx: dict[str, Any] | None = Field(None, description="route, transfer and timings")


class ChatCompletionResponse(BaseModel):
    """The body of a non-streaming chat completion."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    pdx: dict[str, Any] | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    synthetic: bool


class ModelList(BaseModel):
    """``GET /v1/models``."""

    object: Literal["list"]
    data: list[ModelCard]


# --- parsing -----------------------------------------------------------------------------


# A run of 19+ digits (an integer orjson would make a float): digits mapped to "0", the rest to
# " ", then 19 zeros looked for; two C passes, ~10x quicker than a regular expression.
_DIGITS, _LONG_NUMBER = bytes(48 if 48 <= b <= 57 else 32 for b in range(256)), b"0" * 19


def _loads(raw: bytes) -> Any:
    """``json.loads``, through orjson where it gives the same objects (a 300-id prompt parses
    ~10x faster). What orjson refuses but the standard library accepts (NaN, lone surrogates,
    UTF-16, nesting past 1,024, 1e400) and integers past 64 bits (orjson: floats) go to the
    standard library as before: what a request means and every error it gets stay the same."""
    if _LONG_NUMBER not in raw.translate(_DIGITS):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 for bad JSON, deep nesting or lone surrogates."""
    try:
        body = _loads(raw)
    except RecursionError:  # a bracket flood: json's own recursion guard fired
        raise bad_request(
            "body", f"JSON nested deeper than {MAX_JSON_DEPTH}", "invalid_json"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request("body", f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("body", "request body must be a JSON object", "invalid_json")
    _check_tree(body)
    return body


def _check_tree(body: dict[str, Any]) -> None:
    """Depth and string check, iteratively (a recursive walk would itself overflow).

    On the request path of every call: numbers (a prompt of token ids is hundreds of them)
    are skipped without building anything, and a node's path is spelled out only for an
    error.
    """
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(body, (), 1)]
    while stack:
        node, where, depth = stack.pop()
        if type(node) is dict:
            items: Any = node.items()
            for key, _ in items:
                _check_text(key, where)
        elif type(node) is list:
            if depth < MAX_JSON_DEPTH and _SCALARS.issuperset(map(type, node)):
                continue  # all numbers (a prompt of token ids): nothing to check inside
            items = enumerate(node)
        else:
            _check_text(node, where)
            continue
        for key, value in items:
            kind = type(value)
            if kind is not str and kind is not dict and kind is not list:
                if depth >= MAX_JSON_DEPTH:  # a number one level too deep
                    _too_deep((*where, key))
                continue
            if depth >= MAX_JSON_DEPTH:
                _too_deep((*where, key))
            stack.append((value, (*where, key), depth + 1))


_SCALARS = frozenset({int, float, bool, type(None)})


def _path(where: tuple[str | int, ...]) -> str:
    """``messages[0].content`` for ("messages", 0, "content"); "" for the body itself."""
    out = ""
    for part in where:
        out += f"[{part}]" if isinstance(part, int) else (f"{out and '.'}{part}")
    return out


def _too_deep(where: tuple[str | int, ...]) -> None:
    raise bad_request(_path(where) or "body", f"JSON nested deeper than {MAX_JSON_DEPTH}",
                      "invalid_json")  # fmt: skip


def _check_text(text: str, where: tuple[str | int, ...]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        path = _path(where) or "body"
        raise bad_request(
            path, f"{path}: a lone UTF-16 surrogate is not text (escape it or send UTF-8)"
        ) from None


def validate_body(model: type[M], body: dict[str, Any]) -> M:
    """``model`` from ``body``; the first validation error becomes a 400 naming its field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _problem(exc) from None


def _problem(exc: ValidationError) -> HTTPProblem:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "value_error" and isinstance(first.get("ctx", {}).get("error"),
                                                      _FieldProblem):  # fmt: skip
        fp: _FieldProblem = first["ctx"]["error"]
        code = "unsupported_parameter" if fp.why else "invalid_value"
        return bad_request(fp.param, f"{fp.why + ': ' if fp.why else ''}{fp}", code)
    loc = [str(part) for part in first["loc"]]
    top = loc[0] if loc else "body"
    if first["type"] == "extra_forbidden":  # a nested one by its path (pdx_offload.threshold)
        name = ".".join(loc) or top
        return bad_request(name, f"Unrecognized request argument supplied: {name}",
                           "unknown_parameter")  # fmt: skip
    if top in UNSUPPORTED and first["type"] != "missing":
        return bad_request(top, f"{top}: {UNSUPPORTED[top]} (got {first['input']!r:.60})",
                           "unsupported_parameter")  # fmt: skip
    if top == "prompt" and first["type"] != "missing":
        return bad_request("prompt", f"prompt: got {_short(body_value(first))}, expected a "
                           "non-empty string or list of token ids in [0, 2**31), or a "
                           "one-element list of either")  # fmt: skip
    param = _dotted(first["loc"])
    got = "nothing" if first["type"] == "missing" else _short(first["input"])
    return bad_request(param, f"{param}: {first['msg']} (got {got})")


def body_value(error: Any) -> Any:
    """The offending input of a pydantic error."""
    return error.get("input")


def _short(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return f"{value!r:.60}"


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif str(part) in ("str", "list[str]", "list[int]", "int", "float", "bool"):
            continue  # pydantic's union branch names are not fields
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


# --- the validated request ---------------------------------------------------------------


@dataclass
class CompletionRequest:
    """A validated request (completion or chat), resolved against the served model."""

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
    chat: bool = False
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None  # alternatives per token; None = no logprobs
    echo: bool = False
    stop: list[str] = field(default_factory=list)
    include_usage: bool = False
    continuous_usage: bool = False
    prompt_text: str = ""  # for echo
    cache_salt: str = ""  # mixed into the prefix caches' block hashes; "" = none
    offload: OffloadChoice | None = None  # pdx_offload: this request's policy / threshold
    tokens_as_ids: bool = False  # logprobs name tokens "token_id:N"


@dataclass
class ServedModel:
    """What :func:`resolve` checks a request against."""

    names: list[str]  # the first is the canonical name
    max_context_tokens: int
    vocab_size: int | None  # None until a decode instance reported it
    default_max_tokens: int


def prompt_ids(tokenizer: Tokenizer, prompt: Any) -> list[int]:
    """Token ids of a validated ``prompt`` (a one-element batch is unwrapped)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise bad_request("prompt", f"prompt: got a batch of {len(prompt)} prompts, "
                              "expected one (send one request per prompt)")  # fmt: skip
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt:
        return list(prompt)
    raise bad_request("prompt", "prompt: got an empty prompt, expected text or token ids")


def resolve(
    body: SamplingFields,
    ids: list[int],
    served: ServedModel,
    *,
    seed: int,
    chat: bool,
    prompt_text: str = "",
) -> CompletionRequest:
    """The request the gateway runs; 404 for an unknown model, 400 for what the model refuses.

    ``seed`` is used when the body gives none (the gateway draws a fresh one per request).
    """
    model = body.model or served.names[0]
    if model not in served.names:
        raise HTTPProblem(404, f"The model `{model}` does not exist. Served: "
                          f"{', '.join(served.names)}", "model_not_found",
                          param="model")  # fmt: skip
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    max_tokens = max_tokens or served.default_max_tokens
    vocab = served.vocab_size
    if len(ids) + max_tokens > served.max_context_tokens:
        param = "max_completion_tokens" if chat and getattr(body, "max_completion_tokens", None) \
            else "max_tokens"  # fmt: skip
        raise HTTPProblem(400, f"prompt ({len(ids)} tokens) + {param} ({max_tokens}) exceeds "
                          f"the model's context of {served.max_context_tokens} tokens",
                          "context_length_exceeded", param=param)  # fmt: skip
    _check_vocab(ids, body.logit_bias, vocab)
    if body.min_tokens and body.min_tokens > max_tokens:
        raise bad_request("min_tokens", f"min_tokens: got {body.min_tokens}, expected at most "
                          f"max_tokens ({max_tokens})")  # fmt: skip
    if vocab is not None and body.top_k and body.top_k > vocab:
        raise bad_request("top_k", f"top_k: got {body.top_k}, expected -1, 0 or up to {vocab}")
    logprobs: int | None
    if isinstance(body, ChatCompletionBody):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        echo = False
    else:
        assert isinstance(body, CompletionBody)
        logprobs, echo = body.logprobs, bool(body.echo)
    opts = body.stream_options
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return CompletionRequest(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=body.temperature or 0.0,
        seed=body.seed if body.seed is not None else seed,
        stream=bool(body.stream),
        return_token_ids=bool(body.return_token_ids),
        route=body.pdx_route or "auto",
        user=body.user,
        ignore_eos=bool(body.ignore_eos),
        model=model,
        kv_codec=body.pdx_kv_codec or "",
        chat=chat,
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
        min_tokens=body.min_tokens or 0,
        n=body.n or 1,
        logprobs=logprobs,
        echo=echo,
        stop=stops,
        include_usage=bool(opts and opts.include_usage),
        continuous_usage=bool(opts and opts.continuous_usage_stats),
        prompt_text=prompt_text,
        cache_salt=body.cache_salt or "",
        offload=body.pdx_offload,
        tokens_as_ids=bool(body.return_tokens_as_token_ids),
    )


def _check_vocab(ids: list[int], bias: dict[str, float] | None, vocab: int | None) -> None:
    if vocab is None:
        return
    if ids and max(ids) >= vocab:  # max() in C; the first offender only for the message
        bad = next(t for t in ids if t >= vocab)
        raise bad_request("prompt", f"prompt: token id {bad} is outside the vocabulary "
                          f"[0, {vocab})")  # fmt: skip
    for token in bias or {}:
        if int(token) >= vocab:
            raise bad_request("logit_bias", f"logit_bias: token id {token} is outside the "
                              f"vocabulary [0, {vocab})")  # fmt: skip
