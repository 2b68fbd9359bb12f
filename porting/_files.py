"""Small file helpers every layer shares.

One JSON reader for everything flux-port reads from a user (safetensors headers and their metadata, indexes,
configs, manifests, reports, model_index.json): a depth limit, type checks, and an InputError naming the file (exit
2) instead of a RecursionError, a TypeError or a KeyError further on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from porting.errors import InputError

MAX_JSON_DEPTH = 64  # no config, header, index or report flux-port reads nests deeper than a handful of levels

_KINDS = {dict: "a JSON object", list: "a JSON array", str: "a string"}


def _depth(data: Any) -> int:
    """Nesting depth of parsed JSON (iterative: a deep document cannot exhaust the stack here)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            if level > MAX_JSON_DEPTH:
                return level
            stack.extend((v, level + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(text: str | bytes, where: str, *, kind: type | None = None,
               object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """JSON from `text` read at `where` (a file, or a file and a metadata key), nested at most MAX_JSON_DEPTH levels
    and of type `kind` when given; anything else is an InputError naming `where`."""
    try:
        data = json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise InputError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels; refused.",
                         hint="The file is damaged or hostile; no file flux-port reads nests that deep.") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{where}: not valid JSON ({e}).") from e
    if _depth(data) > MAX_JSON_DEPTH:
        raise InputError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels; refused.",
                         hint="The file is damaged or hostile; no file flux-port reads nests that deep.")
    if kind is not None and not isinstance(data, kind):
        raise InputError(f"{where}: expected {_KINDS.get(kind, kind.__name__)}, found {type(data).__name__}.")
    return data


def read_json(path: Path, what: str, *, kind: type | None = dict) -> Any:
    """JSON from the file `path` (see parse_json); a missing or unreadable file is an InputError naming it."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: missing ({what}).")
    try:
        text = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e}).") from e
    return parse_json(text, str(path), kind=kind)


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`, or an InputError naming the file and what it should be."""
    return read_json(path, what, kind=dict)


_MISSING = object()


def json_int(doc: Any, field: str, where: str | Path, *, default: Any = _MISSING, minimum: int | None = None) -> int:
    """The integer `doc[field]` read from `where`; a string, a float, a bool or a missing field (without a default)
    is an InputError naming the file and the field."""
    if not isinstance(doc, dict):
        raise InputError(f"{where}: expected a JSON object, found {type(doc).__name__}.")
    if field not in doc:
        if default is _MISSING:
            raise InputError(f"{where}: no {field!r} field.")
        return default
    value = doc[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: {field!r} is {value!r} ({type(value).__name__}); it must be an integer.")
    if minimum is not None and value < minimum:
        raise InputError(f"{where}: {field!r} is {value}; it must be at least {minimum}.")
    return value
