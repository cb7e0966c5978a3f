"""The gateway's request-body parser: orjson's speed, the standard library's meaning.

Every body must parse to exactly what ``json.loads`` gives (same values, same types: an
integer past 64 bits stays an int) or be refused with the same 400 as before."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdx.serving.gateway.protocol import HTTPProblem, parse_json


def _same(a: Any, b: Any) -> bool:
    """Equal, and of the same type all the way down (1 is not 1.0 here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b or (a != a and b != b)  # NaN


TRICKY = [
    b'{"prompt": [1, 2, 3], "max_tokens": 16}',
    b'{"seed": 18446744073709551616}',  # past 64 bits: an int, as the stdlib reads it
    b'{"seed": -9223372036854775809, "x": 1e400}',
    b'{"temperature": NaN}',
    b'{"a": 1, "a": 2}',  # duplicate keys: the last one wins in both
    b'{"s": "\\ud800"}',  # a lone surrogate escape (the tree check refuses it)
    '{"s": "é"}'.encode("utf-16"),  # the stdlib reads UTF-16 bodies
    b'{"n": -0.0, "m": 1.0, "k": 1E2, "i": 10}',
    b"[1, 2]",
    b"{",
    b'{"x": 1} trailing',
    b"\xff\xfe{}",
]


@pytest.mark.parametrize("raw", TRICKY)
def test_a_body_means_what_the_standard_library_reads(raw: bytes) -> None:
    try:
        expected: Any = json.loads(raw)
    except (ValueError, RecursionError):
        expected = None
    try:
        got: Any = parse_json(raw)
    except HTTPProblem as exc:
        got = exc
    if expected is None or not isinstance(expected, dict):
        assert isinstance(got, HTTPProblem) and got.status == 400
    elif isinstance(got, HTTPProblem):  # only the tree check refuses what the stdlib read
        assert raw == b'{"s": "\\ud800"}' and got.status == 400, got.body()
    else:
        assert _same(got, expected), (got, expected)


def test_deep_nesting_is_refused_not_crashed() -> None:
    with pytest.raises(HTTPProblem) as exc:
        parse_json(b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert exc.value.status == 400


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                  max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=6), JSON, max_size=5))
def test_any_object_parses_to_the_same_values_and_types(body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    try:
        got = parse_json(raw)
    except HTTPProblem:  # the tree check's own refusals (lone surrogates, depth)
        return
    assert _same(got, json.loads(raw))
