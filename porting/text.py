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


def relative_paths(text: str, cwd: str | None = None) -> str:
    """`text` with every absolute path inside the current folder (`cwd`) written relative to it, and the folder
    itself as `.`: what a user typed from there. A path elsewhere, and a folder whose name merely starts the same
    (`/work/a` for `/work/ab`), is left as is. Messages only: `--json` keeps absolute paths."""
    folders = [cwd] if cwd is not None else _current_folders()
    for folder in folders:
        if folder in ("", "/"):
            continue
        text = re.sub(rf"(?<![\w./~-]){re.escape(folder)}(?:/(?=[^\s'\"/])|(?=/?(?:[\s'\"),;:]|$)))", _inside, text)
    return text


def _inside(m: re.Match) -> str:
    """The folder itself is `.`; a path inside it loses the folder and its `/` (`./` before a name that starts
    with `-`, which would read as an option)."""
    if not m.group().endswith("/"):
        return "."
    rest = m.string[m.end():m.end() + 1]
    return "./" if rest == "-" else ""


def _current_folders() -> list[str]:
    """The current folder as the OS names it and, when the shell's $PWD is another spelling of it (a symbolic
    link on the way), as the user sees it."""
    import os

    try:
        here = os.getcwd()
    except OSError:  # the folder was removed under us: nothing is inside it
        return []
    pwd = os.environ.get("PWD", "")
    try:
        same = bool(pwd) and pwd != here and os.path.isabs(pwd) and os.path.samefile(pwd, here)
    except OSError:
        same = False
    return [pwd, here] if same else [here]


_GAP_WORD = re.compile(r"( *)(\S+)")
_LABEL = re.compile(r"\[\d+/\d+\] ")

# A command the user is told to run is kept on one line, never broken (a terminal joins its own soft wraps when the
# line is copied; a line broken here pastes as two commands): `port VERB ...`, `pip install ...`, `python -m ...`,
# up to the end of its clause. A digest is one word that is never folded. (tests/test_columns.py holds the verb
# list to porting/cli/app.py's.)
PORT_VERBS = frozenset({"fetch", "recipes", "inspect", "convert", "merge", "validate", "demo", "publish", "generate",
                        "compare", "bench", "export", "batch", "env"})
_COMMAND_HEADS = {"port": PORT_VERBS, "pip": frozenset({"install", "uninstall"}), "python": frozenset({"-m"})}
_HEX = re.compile(r"^\W*[0-9a-fA-F]{40,}\W*$")
_JOINS = frozenset({"and", "or", "then"})  # "port validate X and port publish Y": two commands
_CLAUSE_END = re.compile(r"(?:[,;`)]|[^./]\.)['\"]?$")


def _command_at(pairs: list[tuple[str, str]], i: int) -> int:
    """The index after the last word of the command starting at word `i`, or `i` when none starts there."""
    head = pairs[i][1].lstrip("`'\"(")
    verbs = _COMMAND_HEADS.get(head)
    if verbs is None or i + 1 >= len(pairs) or pairs[i + 1][1].rstrip(".,;`)'\"") not in verbs:
        return i
    quoted = False
    j = i + 1
    while j < len(pairs):
        word = pairs[j][1]
        if not quoted and (word.startswith("(") or word in _JOINS):
            break
        quoted ^= word.count('"') % 2 == 1
        j += 1
        if not quoted and _CLAUSE_END.search(word):
            break
    return j


def longest_unit(text: str) -> int:
    """The widest thing in `text` a line must hold whole: a word, or a command or a digest (never broken)."""
    return max((len(unit) for line in text.splitlines() for _, unit, _ in _units(line.strip())), default=0)


def _units(body: str) -> list[tuple[str, str, bool]]:
    """(gap, text, whole) of each word of `body`; a command or a digest is one unit, never broken (`whole`)."""
    pairs = _GAP_WORD.findall(body)
    units: list[tuple[str, str, bool]] = []
    i = 0
    while i < len(pairs):
        end = _command_at(pairs, i)
        if end > i:
            text = pairs[i][1] + "".join(gap + word for gap, word in pairs[i + 1:end])
            units.append((pairs[i][0], text, True))
            i = end
            continue
        units.append((pairs[i][0], pairs[i][1], bool(_HEX.match(pairs[i][1]))))
        i += 1
    return units


def wrap_lines(text: str, width: int = 80, continuation: str | None = None) -> str:
    """Each line of `text` wrapped at spaces to `width`, its continuation indented under it (under the text after
    a "[3/9] " step label), or by `continuation` when given (a table cell: ""). A word longer than a line (a path)
    is broken after a `/`: the pieces continue on the lines below, a piece still too long is folded."""
    out: list[str] = []
    for line in text.splitlines() or [""]:
        out.extend(_wrap_line(line, width, continuation))
    return "\n".join(out)


def _wrap_line(line: str, width: int, continuation: str | None = None) -> list[str]:
    if len(line) <= width:
        return [line]
    body = line.lstrip(" ")
    indent = line[: len(line) - len(body)]
    label = _LABEL.match(body)
    follow = continuation if continuation is not None else " " * len(label.group(0)) if label else indent + "  "
    if len(follow) > width // 2:
        follow = "  "
    lines: list[str] = []
    current, empty = indent, True
    for gap, word, whole in _units(body):
        sep = "" if empty else gap
        if len(current) + len(sep) + len(word) <= width:
            current, empty = current + sep + word, False
        elif len(follow) + len(word) <= width or whole:  # whole on a line of its own (a command: even if longer,
            lines.append(current)  # unindented where the indent alone would push it past the width)
            current, empty = (follow if len(follow) + len(word) <= width or len(word) > width else "") + word, False
        else:  # longer than a line: broken after a `/`, as much as fits here first
            pieces = path_pieces(word, width - len(current) - len(sep), width - len(follow))
            lines.append(current + sep + pieces[0] if pieces[0] else current)
            lines.extend(follow + p for p in pieces[1:-1])
            current, empty = follow + pieces[-1], False
    lines.append(current)
    return [ln.rstrip() for ln in lines if ln.strip()] or [""]


def path_pieces(word: str, first: int, room: int) -> list[str]:
    """`word` cut after its `/` separators into pieces of at most `first` characters (the first piece; empty when
    not even the first segment fits there) and `room` (the others); a segment longer than `room` is folded."""
    pieces, current, limit = [], "", max(first, 0)
    for segment in re.findall(r"[^/]*/|[^/]+", word):
        if current and len(current) + len(segment) > limit:
            pieces.append(current)
            current, limit = "", room
        elif not current and not pieces and limit < len(segment) <= room:  # whole on the next line
            pieces.append("")
            limit = room
        elif not current and not pieces and limit <= 0:
            pieces.append("")
            limit = room
        current += segment
        while len(current) > limit:
            pieces.append(current[:limit])
            current, limit = current[limit:], room
    return pieces + [current] if current else pieces


def for_console(text: str, console: Any) -> str:
    """A message as a rich `console` shows it: paths inside the current folder relative to it; wrapped (text.
    wrap_lines) to the console's width on a terminal, or when $COLUMNS sets a width; piped with no $COLUMNS (as
    `port ... | grep` runs: shells do not export it) one line a message, for grep and log readers."""
    import os

    text = relative_paths(text)
    if console.is_terminal or os.environ.get("COLUMNS"):
        text = wrap_lines(text, console.width)
    return text
