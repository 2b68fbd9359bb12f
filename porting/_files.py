"""Small file helpers every layer shares."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from porting.errors import InputError


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`, or an InputError naming the file and what it should be."""
    if not path.is_file():
        raise InputError(f"{path}: missing ({what}).")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{path}: not valid JSON ({e}).") from e
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, found {type(data).__name__}.")
    return data
