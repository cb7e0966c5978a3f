"""The pdx exception tree.

Every error a user can cause or meet derives from :class:`PdxError`. The CLI maps
them to one line on stderr and an exit code in one place (``pdx.cli.main``);
services map them to wire statuses at their own boundary.

    PdxError
    ├── InputError, ConfigError, UnsupportedModelError
    ├── MeasurementError ── link.protocol.ProtocolError
    ├── ServingError ── serving.decode.DecodeFailed, serving.engines.client.EngineUnreachable,
    │                   .EngineHTTPError, serving.engines.vllm.EngineStartError
    ├── transfer.contract.KVError (a contract code; gRPC status / ERROR frame: transfer.rpc,
    │   transfer.dataplane.framing) and transfer.dataplane.framing.FrameError (KV_CORRUPT
    │   where it ends a transfer)
    └── faults' ControlError, NetnsError, EmulatorError; serving.supervisor.DeployError
"""

from __future__ import annotations

from typing import Any


class PdxError(Exception):
    """Base of all pdx errors. ``exit_code`` is what the CLI exits with."""

    exit_code = 2


class InputError(PdxError):
    """Bad user input: names the field, the value given and what was expected."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"{field}: got {value!r}, expected {expected}")


class ConfigError(PdxError):
    """A configuration file or document failed validation; one line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


class UnsupportedModelError(PdxError):
    """A model config pdx cannot size exactly (unknown architecture or missing field)."""


class MeasurementError(PdxError):
    """A measurement could not be taken (peer unreachable, protocol error, ...)."""


class ServingError(PdxError):
    """A serving process could not do what it was asked (an engine down, a decode step failed)."""
