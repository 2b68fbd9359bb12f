"""Text from files and options, made safe to show: control characters displayed as escapes, never obeyed."""

from __future__ import annotations

import re
from typing import Any

# C0 and C1 controls (terminal escape sequences), and the Unicode format controls that reorder or hide text:
# bidirectional marks, embeddings, overrides and isolates (U+061C, U+200E/200F, U+202A-202E, U+2066-2069),
# zero-width and separator characters (U+200B-200D, U+2028/2029, U+2060-2065, U+FEFF).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_CONTROL_AND_LINES = re.compile(r"[\t\n\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escape(m: re.Match) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, lines: bool = True) -> str:
    """`text` with control characters (terminal escape sequences, bidi overrides, zero-width characters) shown as
    `\\x1b` / `\\u202e`, not obeyed: names and messages come from files and options. With `lines=False` newlines
    and tabs are shown too (a tensor name, an error paragraph: one line)."""
    return (_CONTROL if lines else _CONTROL_AND_LINES).sub(_escape, str(text))


def one_line(text: object) -> str:
    """A name read from a file, for a message that lists one item a line."""
    return printable(text, lines=False)


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def markdown_code(value: Any) -> str:
    """Text for a markdown code span inside a table: no backticks, pipes or control characters can escape it."""
    return _UNPRINTABLE.sub("?", str(value)).replace("`", "'").replace("|", "\\|")


def markdown_text(value: Any) -> str:
    """Plain markdown text with HTML and markdown syntax shown, not interpreted."""
    text = _UNPRINTABLE.sub("?", str(value))
    return re.sub(r"([\\`*_{}\[\]()#+!|<>~-])", r"\\\1", text)
