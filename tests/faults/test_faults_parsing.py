"""Property tests for the parsers: addresses and toxic specs never leak a raw exception."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pdx.errors import PdxError
from pdx.faults import parse_hostport, parse_toxic
from pdx.faults.toxics import ALL_TYPES, updated_toxic

NUMERIC_FIELDS = {
    "latency": "latency_ms",
    "bandwidth": "rate_mbps",
    "stall": "duration_ms",
    "reset_peer": "timeout_ms",
    "timeout": "timeout_ms",
    "slow_close": "delay_ms",
    "reorder": "delay_ms",
}


@given(st.ip_addresses(v=4), st.integers(0, 65535))
def test_hostport_round_trip(ip: object, port: int) -> None:
    assert parse_hostport(f"{ip}:{port}", "--listen") == (str(ip), port)


@given(st.text(max_size=30))
@example("0:\u00b2")  # "²".isdigit() is True, int("²") raises
@example("127.0.0.1:\u0663")  # an Arabic-Indic 3: int() reads it, a port must be ASCII
def test_hostport_garbage_is_an_input_error(text: str) -> None:
    try:
        parse_hostport(text, "--upstream")
    except PdxError as exc:
        assert str(exc).startswith("--upstream: got ")


@pytest.mark.parametrize("port", ["\u00b2", "\u0663", "\uff18\uff10"])  # ², ٣, fullwidth 80
def test_a_port_is_ascii_digits(port: str) -> None:
    with pytest.raises(PdxError, match="HOST:PORT"):
        parse_hostport(f"127.0.0.1:{port}", "--upstream")


@given(
    st.sampled_from(sorted(NUMERIC_FIELDS)),
    st.one_of(
        st.floats(max_value=-1e-9, allow_nan=False),
        st.just(math.nan),
        st.just(math.inf),
        st.just(-math.inf),
    ),
)
def test_bad_numbers_are_rejected_with_the_field_named(kind: str, value: float) -> None:
    field = NUMERIC_FIELDS[kind]
    spec = {"type": kind, field: value, "probability": 0.5, "rate_mbps": 1.0} | {field: value}
    if kind not in ("reorder", "stall"):
        spec.pop("probability")
    if kind != "bandwidth":
        spec.pop("rate_mbps")
    with pytest.raises(PdxError, match=field):
        parse_toxic(spec)


@given(st.text(max_size=12).filter(lambda t: t not in ALL_TYPES))
def test_unknown_type_names_the_choices(kind: str) -> None:
    with pytest.raises(PdxError, match=r"toxic\.type"):
        parse_toxic({"type": kind})


@given(st.floats(0, 1e6, allow_nan=False), st.floats(0, 1e3, allow_nan=False))
def test_update_keeps_identity_and_validates(latency_ms: float, jitter_ms: float) -> None:
    toxic = parse_toxic({"type": "latency", "name": "wan"})
    new = updated_toxic(toxic, {"latency_ms": latency_ms, "jitter_ms": jitter_ms})
    assert (new.name, new.type, new.latency_ms) == ("wan", "latency", latency_ms)  # type: ignore[union-attr]
    with pytest.raises(PdxError, match=r"toxic\.type"):
        updated_toxic(toxic, {"type": "bandwidth"})
