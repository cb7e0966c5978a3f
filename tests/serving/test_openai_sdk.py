"""The official ``openai`` SDK against a real deployment (child processes, mutual TLS inside).

Every parameter the gateway supports is sent through the SDK; where the result is exact
(greedy or seeded), it is compared with the same sampler run in this process on the same
model, so a parameter that did not travel or was ignored fails here. Errors are parsed by the
SDK's own exception classes.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from live_deploy import live_deployment

from pdx.serving.backends import create_backend
from pdx.serving.backends.sampling import Sampling, choose
from pdx.serving.backends.tokenizer import ByteTokenizer
from pdx.serving.deploy_config import DeployConfig

pytestmark = pytest.mark.slow

OVERRIDES = ["gateway.port=0", "decode.max_batch=4", "decode.max_queue=0",
             "router.local_prefill_max_tokens=16", "kv.kv_transfer_timeout_ms=10000",
             "gateway.model_aliases=[tiny]"]  # fmt: skip
PROMPT = "The quick brown fox jumps over the lazy dog"
MODEL = "tiny-llama"
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    """A real deployment (prefill and decode processes); its gateway URL."""
    with live_deployment(OVERRIDES) as dep:
        yield dep.endpoints().gateway


@pytest.fixture(scope="module")
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference() -> Any:
    """The same model and sampler in this process: what a request must produce."""
    backend = create_backend(DeployConfig().model)

    def generate(prompt: list[int], n: int, sp: Sampling, ignore_eos: bool = True) -> list[int]:
        state, logits = backend.prefill(prompt)
        out: list[int] = []
        while len(out) < n:
            tok = choose(logits, sp, prompt=prompt, output=out,
                         eos_token_id=backend.eos_token_id).token  # fmt: skip
            out.append(tok)
            if tok == backend.eos_token_id and not ignore_eos:
                break
            states, batch = backend.decode_step([state], [tok])
            state, logits = states[0], batch[0]
        return out

    return generate


def ids_of(choice: Any) -> list[int]:
    return list(choice.model_extra["token_ids"])


def complete(client: openai.OpenAI, route: str = "auto", **kw: Any) -> Any:
    extra = {"return_token_ids": True, "ignore_eos": True, "pdx_route": route,
             **kw.pop("extra_body", {})}  # fmt: skip
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, **kw}
    return client.completions.create(**args, extra_body=extra)


def test_completion_and_usage(client: openai.OpenAI, reference: Any) -> None:
    r = complete(client, "disaggregated")
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    want = reference(TOK.encode(PROMPT), 12, Sampling())
    assert ids_of(r.choices[0]) == want and r.choices[0].text == TOK.decode(want)
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12 == len(PROMPT) + 12
    assert r.model_extra["pdx"]["route"] == "disaggregated"


def test_streaming_completion_usage_only_when_asked(client: openai.OpenAI) -> None:
    whole = complete(client)
    chunks = list(complete(client, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    plain = list(complete(client, stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    assert plain[-1].choices[0].finish_reason == "length"


def test_chat_out_of_the_box(client: openai.OpenAI, reference: Any) -> None:
    messages: Any = [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hello"},
                                                  {"type": "text", "text": "there"}]}]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3,
                                       extra_body={"return_token_ids": True,
                                                   "ignore_eos": True})  # fmt: skip
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and r.usage is not None and r.usage.completion_tokens == 3
    # The template's prompt: content parts joined by a newline.
    prompt = TOK.apply_chat_template([{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": "hello\nthere"}])  # fmt: skip
    assert r.choices[0].model_extra["prompt_token_ids"] == prompt
    assert ids_of(r.choices[0]) == reference(prompt, 3, Sampling())
    stream = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))  # fmt: skip
    assert stream[0].choices[0].delta.role == "assistant"
    assert all(c.id == stream[0].id and c.id.startswith("chatcmpl-") for c in stream)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == msg.content
    assert stream[-1].choices == [] and stream[-1].usage.completion_tokens == 3


def test_models_list_retrieve_and_unknown(client: openai.OpenAI) -> None:
    listed = client.models.list()
    assert [m.id for m in listed.data] == [MODEL, "tiny"]
    card = client.models.retrieve(MODEL)
    assert card.owned_by == "pdx" and card.created > 0
    assert card.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4o")
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert exc.value.code == "model_not_found" and exc.value.param == "model"


@pytest.mark.parametrize(
    ("params", "sampling"),
    [
        ({"temperature": 1.0, "seed": 7}, Sampling(temperature=1.0, seed=7)),
        ({"temperature": 0.8, "top_p": 0.5, "seed": 3},
         Sampling(temperature=0.8, top_p=0.5, seed=3)),
        ({"temperature": 1.2, "seed": 5, "extra_body": {"top_k": 3}},
         Sampling(temperature=1.2, seed=5, top_k=3)),
        ({"temperature": 1.0, "seed": 9, "extra_body": {"min_p": 0.5}},
         Sampling(temperature=1.0, seed=9, min_p=0.5)),
        ({"frequency_penalty": 1.5}, Sampling(frequency_penalty=1.5)),
        ({"presence_penalty": -1.0}, Sampling(presence_penalty=-1.0)),
        ({"extra_body": {"repetition_penalty": 1.8}}, Sampling(repetition_penalty=1.8)),
        ({"logit_bias": {"105": 3.0, "106": -100}}, Sampling(logit_bias={105: 3.0, 106: -100.0})),
    ],
)  # fmt: skip
def test_sampling_parameters_apply_exactly(
    client: openai.OpenAI, reference: Any, params: dict[str, Any], sampling: Sampling
) -> None:
    for route in ("local", "disaggregated"):
        got = ids_of(complete(client, route, **dict(params)).choices[0])
        assert got == reference(TOK.encode(PROMPT), 12, sampling), route


def test_seeded_is_reproducible_unseeded_is_not(client: openai.OpenAI) -> None:
    a = ids_of(complete(client, temperature=1.0, seed=11, max_tokens=24).choices[0])
    b = ids_of(complete(client, temperature=1.0, seed=11, max_tokens=24).choices[0])
    c = ids_of(complete(client, temperature=1.0, max_tokens=24).choices[0])
    d = ids_of(complete(client, temperature=1.0, max_tokens=24).choices[0])
    assert a == b and c != d  # 24 draws from a near-flat 260-way distribution never all agree


def test_n_choices(client: openai.OpenAI) -> None:
    r = complete(client, n=3, temperature=1.0, seed=1, max_tokens=6)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({tuple(ids_of(c)) for c in r.choices}) == 3
    assert r.usage.completion_tokens == 18
    chunks = list(complete(client, n=2, temperature=1.0, seed=1, max_tokens=6, stream=True))
    texts = ["", ""]
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [r.choices[0].text, r.choices[1].text]


def test_stop_strings(client: openai.OpenAI) -> None:
    whole = complete(client, max_tokens=40).choices[0].text
    k = next(i for i in range(3, len(whole))
             if whole[i] != "\ufffd" and whole[i] not in whole[:i])  # fmt: skip
    for stream in (False, True):
        r = complete(client, max_tokens=40, stop=[whole[k], "\x00never"], stream=stream)
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (whole[:k], "stop")


def test_logprobs_echo_min_tokens(client: openai.OpenAI) -> None:
    r = complete(client, logprobs=2, max_tokens=5)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == 5 and len(lp.top_logprobs) == 5
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) <= 2 and value <= 0 and value == pytest.approx(max(top.values()))
    assert lp.text_offset[0] == 0
    echo = complete(client, echo=True, max_tokens=3)
    assert echo.choices[0].text.startswith(PROMPT) and len(echo.choices[0].text) > len(PROMPT)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True,
        top_logprobs=3, stream=False, extra_body={"ignore_eos": True})  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    assert all(isinstance(t.bytes, list) for t in content)
    # EOS (id 1) made the only choice: finish "stop" at once, unless min_tokens holds it off.
    eos = {"1": 100}
    short = complete(client, logit_bias=eos, extra_body={"ignore_eos": False})
    held = complete(client, logit_bias=eos, extra_body={"ignore_eos": False, "min_tokens": 4})
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 5 and ids_of(held.choices[0])[-1] == 1


def test_tokens_as_token_ids_name_every_logprob_by_its_id(client: openai.OpenAI) -> None:
    # vLLM's return_tokens_as_token_ids: "token_id:N" for the chosen token and its alternatives,
    # the same ids the choice's token_ids give (what a replay needs to find a token exactly).
    r = complete(client, logprobs=3, max_tokens=5,
                 extra_body={"return_tokens_as_token_ids": True})  # fmt: skip
    lp, ids = r.choices[0].logprobs, ids_of(r.choices[0])
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and all(k.startswith("token_id:") for k in top)
        assert top[token] == pytest.approx(value) == pytest.approx(max(top.values()))
    plain = complete(client, logprobs=3, max_tokens=5)
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    assert all(t.token.startswith("token_id:") for t in content)
    assert all(a.token.startswith("token_id:") for t in content for a in t.top_logprobs)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"seed": 2**70}, "seed"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"extra_body": {"nonsense": 1}}, "nonsense"),
    ],
)  # fmt: skip
def test_errors_parse_as_sdk_exceptions(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", **kwargs)
    err = exc.value
    assert err.status_code == 400 and err.type == "invalid_request_error"
    assert err.param == param and param in err.message
    assert err.code is None or isinstance(err.code, str)


def test_chat_refuses_what_it_does_not_serve(client: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for kwargs, param in [
        ({"tools": tools}, "tools"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ]:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], **kwargs
            )
        assert exc.value.param is not None and exc.value.param.startswith(param)


def test_overload_is_a_rate_limit_error(client: openai.OpenAI) -> None:
    # Capacity is 4 sequences; 12 long requests at once: the rest are refused early.
    def one(_: int) -> str:
        try:
            complete(client, "local", max_tokens=300)
            return "ok"
        except openai.RateLimitError as exc:
            assert exc.type == "rate_limit_error" and exc.code == "overloaded"
            assert exc.response.headers["Retry-After"] == "1"
            return "429"

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    assert results.count("429") >= 4 and "ok" in results
