"""One error hierarchy for every verb; each class carries its exit code and a hint."""

from __future__ import annotations

import os
import re
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


# --- credentials: never echoed ------------------------------------------------------------------------------------
# An argument may hold a credential (a token pasted into --push, a URL with `user:token@`); whatever flux-port shows
# or writes of it goes through `redact`: every error's text (PortError below), every line, table and JSON document
# the CLI prints (cli/_output.py) and every JSON file written through `finite.dumps` (reports, journals, manifests).
REDACTED = "***"
TOKEN_ENV = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MODELSCOPE_API_TOKEN")
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#@'\"\\<>]+@")  # scheme://user:token@host
_TOKEN_SHAPES = re.compile(r"\b(?:hf_|api_(?:org_)?)[A-Za-z0-9]{30,}\b")  # Hugging Face user / org tokens
_SECRET_QUERY = re.compile(r"(?i)([?&](?:access_token|token|api_key|apikey|key|sig|signature|password|secret)=)"
                           r"[^&\s'\"#]+")
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]{8,}")
_extra_secrets: set[str] = set()


def add_secret(value: str | None) -> None:
    """Treat `value` (a token a client found in a login file, say) as a secret for the rest of this process."""
    if value and len(value) >= 8:
        _extra_secrets.add(value)


def _secrets() -> list[str]:
    values = {os.environ.get(k) or "" for k in TOKEN_ENV} | _extra_secrets
    return sorted((v for v in values if len(v) >= 8), key=len, reverse=True)


def redact(text: str) -> str:
    """`text` with every credential it may hold replaced by `***`: a URL's `user:password@`, the value of the token
    variables (HF_TOKEN, HUGGING_FACE_HUB_TOKEN, MODELSCOPE_API_TOKEN) and of tokens seen this run, Hugging Face
    token shapes (`hf_...`), `token=` / `sig=` query values and `Bearer` headers."""
    if not text:
        return text
    for secret in _secrets():
        text = text.replace(secret, REDACTED)
    text = _USERINFO.sub(lambda m: f"{m.group(1)}{REDACTED}@", text)
    text = _TOKEN_SHAPES.sub(REDACTED, text)
    text = _SECRET_QUERY.sub(lambda m: m.group(1) + REDACTED, text)
    return _BEARER.sub(lambda m: m.group(1) + REDACTED, text)


def holds_secret(text: str) -> bool:
    return redact(text) != text


def redact_doc(doc: Any) -> Any:
    """`doc` (JSON-like) with every string, keys included, passed through `redact`."""
    if isinstance(doc, str):
        return redact(doc)
    if isinstance(doc, dict):
        return {redact(k) if isinstance(k, str) else k: redact_doc(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [redact_doc(v) for v in doc]
    return doc


class PortError(Exception):
    """Base error: a message for the user, an optional next step, and an exit code. Its texts are redacted as they
    are set (`redact`): no error carries a credential to a terminal, a --json document or a journal."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, hint: str | None = None, details: str | None = None):
        self.message = message
        self.hint = hint
        self.details = details

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("message", "hint", "details") and isinstance(value, str):
            value = redact(value)
            if name == "message":
                self.args = (value,)
        super().__setattr__(name, value)


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
