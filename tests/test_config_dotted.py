"""``--set a.b[N].c=V``: a list index must be ASCII digits; anything else is an InputError that
names the flag, never a raw ValueError (``"²".isdigit()`` is True, ``int("²")`` raises)."""

from __future__ import annotations

import pytest

from pdx.config import set_dotted
from pdx.errors import InputError


def test_an_index_sets_that_item() -> None:
    data = {"a": [{"c": 1}, {"c": 2}]}
    set_dotted(data, "a[1].c", 5)
    assert data == {"a": [{"c": 1}, {"c": 5}]}


@pytest.mark.parametrize("index", ["\u00b2", "\u0663", "x", "-1", ""])
def test_an_index_that_is_not_ascii_digits_is_an_input_error(index: str) -> None:
    with pytest.raises(InputError, match="list indexes as \\[N\\]") as exc:
        set_dotted({"a": [{"c": 1}]}, f"a[{index}].c", 5)
    assert str(exc.value).startswith("--set: got ")
