"""One error hierarchy for every verb; each class carries its exit code and a hint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# Exit codes shared by all verbs (docs/exit-codes.md).
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NETWORK = 4
EXIT_DISK = 5
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM


class PortError(Exception):
    """Base error: a message for the user, an optional next step, and an exit code."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, hint: str | None = None, details: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details


class UsageError(PortError):
    """An option or argument the verb cannot use (a malformed size, an empty list, a value out of range)."""


class InternalError(PortError):
    """An invariant of flux-port itself broke: a bug to report, not a fault in the user's input."""

    exit_code = EXIT_INTERNAL  # sysexits EX_SOFTWARE

    def __init__(self, message: str, hint: str | None = None, details: str | None = None):
        super().__init__(f"internal error: {message}",
                         hint or "This is a bug in flux-port, not in your files; please report it with the command "
                                 "you ran (FLUX_PORT_DEBUG=1 shows the traceback).", details)


class Interrupted(PortError):
    """The user pressed Ctrl-C (or the process got SIGTERM: exit code EXIT_TERMINATED then)."""

    exit_code = EXIT_INTERRUPTED


class Terminated(KeyboardInterrupt):
    """Raised by the CLI's SIGTERM handler: the same path as Ctrl-C, so every cleanup that Ctrl-C runs runs."""


class InputError(PortError):
    """The input file or folder cannot be read as a checkpoint."""


class UnsupportedFormatError(InputError):
    """A pickle checkpoint or another format flux-port refuses to open."""


class UnknownArchitectureError(InputError):
    """The keys match no known mapping table."""


class OutputExistsError(PortError):
    """The destination exists and --force was not given."""


class MappingTableError(PortError):
    """A mapping table is malformed (a bug in the table, not in the user's input)."""


class PlanError(PortError):
    """The strict plan found missing, unexpected or mis-shaped keys."""

    exit_code = EXIT_CHECK_FAILED

    def __init__(self, message: str, hint: str | None = None, details: str | None = None,
                 report: dict | None = None):
        super().__init__(message, hint, details)
        self.report = report or {}


class ConfigMismatchError(PlanError):
    """The checkpoint does not fit the base config given with --config."""


class CheckFailed(PortError):
    """A check ran and said no (validation verdict, hash mismatch)."""

    exit_code = EXIT_CHECK_FAILED


class DeviceError(PortError):
    """The requested device or backend is not available."""


class AuthError(PortError):
    exit_code = EXIT_AUTH


class NetworkError(PortError):
    exit_code = EXIT_NETWORK


class DiskSpaceError(PortError):
    exit_code = EXIT_DISK


class UnsupportedQuantizationError(PortError):
    """A quantized layout flux-port recognises but cannot turn into plain weights exactly (it refuses, naming it)."""

    exit_code = EXIT_CHECK_FAILED


# --- options given where they do not apply: the tables are the verbs' (cli/_options.py, validation/options.py) ---

@dataclass(frozen=True)
class Refusal:
    """What an option given where it does not apply says: `message` and `hint` are formatted with `flag` (the option
    as given, e.g. `--lora-style kohya`) and the verb's own fields (`src`, `quantize`, ...). `usage`: UsageError, else
    PortError (both exit 2)."""
    message: str
    hint: str | None = None
    usage: bool = True

    def error(self, **fields: Any) -> PortError:
        hint = None if self.hint is None else self.hint.format(**fields)
        return (UsageError if self.usage else PortError)(self.message.format(**fields), hint=hint)


@dataclass(frozen=True)
class Applies:
    """The input kinds (or modes) an option applies to. Given with any other kind: `per_kind[kind]`, else `refusal`.
    `needs[kind]`: another option that must be given with it for that kind, and what its absence says."""
    kinds: frozenset[str]
    refusal: Refusal
    per_kind: Mapping[str, Refusal] = field(default_factory=dict)
    needs: Mapping[str, tuple[str, Refusal]] = field(default_factory=dict)


def refuse_inapplicable(table: Mapping[str, Applies], kind: str, given: Mapping[str, str | None],
                        **fields: Any) -> None:
    """Raise the refusal of the first option of `table` (in its order) that `given` names (not None) and that does
    not apply to `kind`, or that lacks an option it needs there. `fields` fill the messages."""
    for option, applies in table.items():
        flag = given.get(option)
        if flag is None:
            continue
        if kind not in applies.kinds:
            raise applies.per_kind.get(kind, applies.refusal).error(flag=flag, **fields)
        needed = applies.needs.get(kind)
        if needed is not None and given.get(needed[0]) is None:
            raise needed[1].error(flag=flag, **fields)
