"""The fields a config gives the KV sizing: read from the file, checked, never defaulted.

:class:`Fields` reads each value a sizing rule needs from the file (``--set`` included) or from
a documented derivation, and collects every problem (a missing field, a value that is not a
positive integer, KV heads that do not divide the attention heads) so that one error names them
all on one line (:class:`FieldProblems`); :func:`screen_values` checks the file's integer fields
before any library reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from pdx.errors import UnsupportedModelError
from pdx.kv.hfconfig import CLASS_DERIVED, ResolvedConfig, one_line

#: Integer fields the rules read (here and in :mod:`pdx.kv.params`): when the file sets one, it
#: must be a positive integer (checked before any library reads the file).
POSITIVE_INTS = frozenset(
    {
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "attention_head_dim", "vocab_size", "intermediate_size",
        "intermediate_size_mlp", "moe_intermediate_size", "sliding_window",
        "attention_chunk_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
        "qk_nope_head_dim", "v_head_dim", "index_head_dim", "conv_dim", "conv_L_cache",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "linear_conv_kernel_dim", "linear_num_heads", "linear_head_dim",
        "short_conv_kernel_size", "mamba_n_heads", "mamba_num_heads", "n_mamba_heads",
        "mamba_d_head", "mamba_head_dim", "mamba_headdim", "mamba_d_state", "ssm_state_size",
        "state_size", "mamba_n_groups", "n_groups", "mamba_ngroups", "mamba_num_groups",
        "mamba_d_conv", "conv_kernel",
    }
)  # fmt: skip
#: Expert counts: a dense config may set them to 0; the parameter count wants them positive
#: where it reads them (MoE layers).
COUNTS = frozenset(
    {"n_routed_experts", "num_experts_per_tok", "num_local_experts", "num_experts",
     "experts_per_token", "n_shared_experts", "first_k_dense_replace"}
)  # fmt: skip
POSITIVE_INT = "a positive integer"


def is_positive_int(value: Any) -> TypeGuard[int]:
    """Whether ``value`` is an int above 0 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def screen_values(text: dict[str, Any]) -> dict[str, str]:
    """Problems with the integer fields the file sets, ``{field: "got X, expected Y"}``.

    Run on the file before transformers reads it, so a bad value is named by pdx once
    (not dropped, defaulted or reported in a foreign message). Per-layer lists are left to
    the configuration class.
    """
    problems: dict[str, str] = {}
    for key, value in text.items():
        if value is None or isinstance(value, list):
            continue
        if key in POSITIVE_INTS and not is_positive_int(value):
            problems[key] = f"got {value!r}, expected {POSITIVE_INT}"
        elif key in COUNTS and not (value == 0 or is_positive_int(value)):
            problems[key] = f"got {value!r}, expected an integer >= 0"
    heads, kv = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if is_positive_int(heads) and is_positive_int(kv) and heads % kv:
        problems["num_key_value_heads"] = (
            f"got {kv!r}, expected a divisor of num_attention_heads ({heads})"
        )
    hidden = text.get("hidden_size")
    no_dim = text.get("head_dim") is None and text.get("attention_head_dim") is None
    if no_dim and is_positive_int(hidden) and is_positive_int(heads) and hidden % heads:
        problems["head_dim"] = (
            f"got nothing, expected a head size (hidden_size {hidden} is not a multiple of "
            f"num_attention_heads {heads})"
        )
    return problems


def problem_line(
    problems: dict[str, str], missing: Sequence[str] = (), needed_for: str = "to size the KV cache"
) -> str:
    """One line: ``field: got X, expected Y; ...; missing a, b: needed to ... (the way out)``."""
    parts = [f"{key}: {what}" for key, what in problems.items()]
    if missing:
        them = "it" if len(missing) == 1 else "them"
        parts.append(
            f"missing {', '.join(missing)}: needed {needed_for} (add {them} to the config or "
            "pass --set FIELD=VALUE)"
        )
    return "; ".join(parts)


class FieldProblems(UnsupportedModelError):
    """Fields the sizing needs are missing or bad; ``problems`` maps each bad one to what is
    wrong with it, ``missing`` lists the rest. The message is one line (:func:`problem_line`)."""

    def __init__(self, problems: dict[str, str], missing: list[str], needed_for: str) -> None:
        self.problems = dict(problems)
        self.missing = list(missing)
        self.needed_for = needed_for
        super().__init__(problem_line(problems, missing, needed_for))


@dataclass
class Fields:
    """Reads the fields the rules need, from the file, and collects every problem to name at once.

    ``cfg`` holds the values as the configuration class read them (``resolved.text``) or, with
    no class, the file itself. A value counts only when the file sets it (``--set`` included)
    or a documented rule derives it from fields the file sets (:meth:`derive`); a class
    default never stands in for a missing field.
    """

    cfg: dict[str, Any]
    model_type: str
    resolved: ResolvedConfig | None = None
    problems: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    derived: dict[str, str] = field(default_factory=dict)
    read: set[str] = field(default_factory=set)
    needed_for: str = "to size the KV cache of model_type {model_type!r}"

    @property
    def _library(self) -> ResolvedConfig | None:
        return self.resolved if self.resolved and self.resolved.library else None

    def in_file(self, key: str) -> bool:
        """Whether the file sets ``key`` (not null), under its name or the class's alias."""
        lib = self._library
        return lib.in_file(key) if lib else self.cfg.get(key) is not None

    def file_value(self, key: str) -> Any:
        """The value the file gives ``key``."""
        lib = self._library
        return lib.file_value(key) if lib else self.cfg.get(key)

    def class_name(self) -> str:
        """The configuration class that read the file (for notes and messages)."""
        lib = self._library
        return f"{lib.library}'s {lib.class_name}" if lib else "pdx"

    def marker(self, *keys: str) -> Any:
        """The first of ``keys`` the config (file or class) sets: recognises a family, never
        a size (a class only has the fields of its own family)."""
        for key in keys:
            if self.cfg.get(key) is not None:
                return self.cfg[key]
        return None

    def optional(self, *keys: str) -> Any:
        """The first of ``keys`` the file sets, else None; a class default that would switch
        a feature on (anything but null, false or 0) is a missing field."""
        for key in keys:
            self.read.add(key)
            if self.in_file(key):
                return self._value(key)
        for key in keys:
            value = self.cfg.get(key)
            if value is None or value is False or (isinstance(value, int) and value == 0):
                continue
            if key in CLASS_DERIVED:
                return self._class_derived(key, value)
            self.need(key)
            return value
        return next((self.cfg[k] for k in keys if self.cfg.get(k) is not None), None)

    def need(self, *keys: str) -> None:
        """Record ``keys`` (aliases of one field) as missing from the file."""
        name = " / ".join(keys)
        if name not in self.missing and not any(k in self.problems for k in keys):
            self.missing.append(name)

    def problem(self, key: str, what: str) -> None:
        """Record one problem with a field (one per field, however many layers read it)."""
        self.problems.setdefault(key, what)

    def derive(self, key: str, value: Any, how: str) -> Any:
        """Use a value a documented rule derives from fields the file sets; said in notes."""
        self.derived.setdefault(key, f"{key} = {value} ({how})")
        return value

    def get(self, *keys: str) -> Any:
        """A field the sizing needs, any type (aliases in order); a missing one is recorded."""
        for key in keys:
            self.read.add(key)
            if self.in_file(key):
                return self._value(key)
        self.need(*keys)
        return None

    def int(self, *keys: str) -> int:
        """A positive integer the sizing needs (see :meth:`get`); placeholder 1 on problems."""
        value = self.get(*keys)
        if value is None:
            return 1
        key = next(k for k in keys if self.in_file(k))
        if key in self.problems:
            return 1
        raw = self.file_value(key)
        if not is_positive_int(raw):
            self.problem(key, f"got {raw!r}, expected {POSITIVE_INT}")
            return 1
        return value if is_positive_int(value) else int(raw)

    def _value(self, key: str) -> Any:
        """The class's reading of a field the file sets (the file's when the class dropped it)."""
        lib = self._library
        if lib is not None and key in lib.dropped and key not in self.problems:
            self.problem(
                key,
                f"got {self.file_value(key)!r}, expected a value {self.class_name()} accepts "
                f"({one_line(lib.dropped[key], 120)})",
            )
        value = self.cfg.get(key)
        return value if value is not None else self.file_value(key)

    def _class_derived(self, key: str, value: Any) -> Any:
        """A per-layer pattern the class derived: its own documented rule, accepted when every
        field it used is in the file."""
        lib = self._library
        inputs = lib.derived_inputs.get(key, {}) if lib else {}
        for knob in inputs:
            if lib is not None and lib.in_file(knob):  # in the file, but the class dropped it
                self.problem(
                    knob, f"got {lib.file_value(knob)!r}, expected a value {self.class_name()} "
                    f"accepts (it derives {key} from it)",
                )  # fmt: skip
            else:
                self.need(knob)
        if not inputs:
            self.derive(key, summary(value), f"derived by {self.class_name()} from the file")
        return value

    def check(self) -> None:
        """Raise one error naming every problem and every missing field, on one line."""
        if self.problems or self.missing:
            needed_for = self.needed_for.format(model_type=self.model_type)
            raise FieldProblems(self.problems, self.missing, needed_for)

    def notes(self) -> list[str]:
        """One note per derived value."""
        return [f"not in the config, derived: {how}" for how in self.derived.values()]


def summary(value: Any) -> str:
    """A per-layer list as ``34 layers: 29 sliding_attention, 5 full_attention``."""
    if not isinstance(value, list):
        return repr(value)
    counts: dict[str, int] = {}
    for item in value:
        counts[str(item)] = counts.get(str(item), 0) + 1
    return f"{len(value)} layers: " + ", ".join(f"{n} {k}" for k, n in counts.items())
