"""`pdx report diff`'s change column: what the shown figures carry, without float residue."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pdx.accept.report.diff import difference
from pdx.accept.report.show import shown_change


def test_the_change_is_what_the_shown_figures_say() -> None:
    assert shown_change(0.998, 0.9990001, 0.9990001 - 0.998) == 0.001  # not 0.0010001
    assert shown_change(0.9990001, 0.999, 0.9990001 - 0.999) == 0.0  # both show 0.999
    assert shown_change(None, 0.5, None) is None
    assert difference(0.995, 0.996) == 0.001 and f"{0.996 - 0.995:.4g}" == "0.001"


@given(st.floats(-1e6, 1e6), st.floats(-1e6, 1e6))
def test_difference_is_the_subtraction_to_twelve_digits(a: float, b: float) -> None:
    exact = b - a
    scale = max(abs(a), abs(b), 1e-300)
    assert abs(difference(a, b) - exact) <= 1e-11 * scale
