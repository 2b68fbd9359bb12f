"""The one output sink: data to stdout (a rich table, or one JSON document with --json), everything else to stderr."""

from __future__ import annotations

import re
import sys
import textwrap
from contextlib import contextmanager
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterator

from porting.errors import redact
from porting.finite import dumps
from porting.text import for_console, longest_unit, printable, relative_paths, wrap_lines

if TYPE_CHECKING:  # rich is imported on first use: `port --help` and `port --version` never print through it
    from rich.console import Console, Group
    from rich.table import Table
    from rich.text import Text


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet or json_mode
        self.documented = False  # --json prints exactly one document

    # the terminal's width, else $COLUMNS, else 80 columns off a terminal (rich's own rule); tables that do not
    # fit go vertical (see table())
    # no emoji codes: a path ending in `:abc:` is a path; no markup in what is printed (see table())
    @cached_property
    def out(self) -> Console:
        from rich.console import Console

        return Console(file=sys.stdout, highlight=False, emoji=False)

    @cached_property
    def err(self) -> Console:
        from rich.console import Console

        return Console(file=sys.stderr, highlight=False, emoji=False)

    def status(self, text: str) -> None:
        """A progress line for humans (stderr); silent in --quiet and --json."""
        if not self.quiet:
            self._line(self.err, printable(text, lines=False))

    @staticmethod
    def _line(console: Console, text: str) -> None:
        """One message, through text.for_console: paths inside the current folder relative; wrapped at spaces (a
        long path after a `/`) to the width on a terminal (which cuts words at its edge) or when $COLUMNS sets one;
        piped with no $COLUMNS, one line, as grep and log readers want it."""
        console.print(for_console(redact(text), console), markup=False, soft_wrap=True)

    def result(self, text: str) -> None:
        """A line of data for humans (stdout); silent in --json."""
        if not self.json_mode:
            self._line(self.out, printable(text))

    def document_text(self, text: str) -> None:
        """A document for humans on stdout (markdown): printed as it is, its lines neither wrapped nor rewritten."""
        if not self.json_mode:
            self.out.print(printable(redact(text)), markup=False, soft_wrap=True)

    def table(self, table: Table) -> None:
        """Print `table` within the console's width: as is when every word fits its column, else vertically (one
        `column  value` line per cell, rows apart), so no line is wider than the console and no word is cut where a
        column is narrow. --json prints the full values instead."""
        if self.json_mode:
            return
        from rich.text import Text

        for column in table.columns:  # cells hold key names and paths from files: show control characters
            # and newlines, and print them as plain text ('[b]' or ':abc:' in a path is not markup or emoji);
            # a cell made with cell() keeps its deliberate line breaks
            # a path inside the current folder is shown relative to it, as in messages
            column._cells = [Text(relative_paths(printable(redact(c), lines=False))) if isinstance(c, str)
                             else _redacted(c) for c in column._cells]
        if isinstance(table.title, str):
            table.title = Text(printable(redact(table.title), lines=False))
        width = self.out.width
        if not fits(self.out, table, width):  # rich's own layout cuts a word: widths that keep each whole, if any
            keep_words_whole(self.out, table, width)
        with self.out.capture() as captured:  # printed without the blanks rich pads the lines with
            if fits(self.out, table, width):
                self.out.print(table)
            else:  # lines made to fit; a digest or command longer than the width stays whole
                self.out.print(vertical(table, width), soft_wrap=True)
        self.out.file.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))

    def document(self, doc: Any) -> None:
        """One JSON document on stdout; NaN / Inf (no JSON number) are written as null, listed in the document
        under `null_means_not_finite` and named on stderr."""
        if self.json_mode and not self.documented:
            replaced: list[str] = []
            text = dumps(doc, replaced, indent=2, default=str)
            for path in replaced:
                self.warning(f"{path} is not a finite number; written as null")
            sys.stdout.write(text + "\n")
            self.documented = True

    def error(self, text: str, lines: bool = False) -> None:
        """An error paragraph (one line: a newline in a name from a file is shown as \\x0a); `lines=True` for
        details that list one item a line."""
        self._line(self.err, printable(text, lines=lines))

    def note(self, text: str) -> None:
        """A line for humans on stderr that --quiet keeps (a caveat under a table)."""
        self._line(self.err, printable(text, lines=False))

    def warning(self, text: str) -> None:
        self._line(self.err, printable(f"Warning: {text}", lines=False))

    def hint(self, text: str) -> None:
        if not self.quiet:
            self._line(self.err, printable(f"Hint: {text}", lines=False))

    @contextmanager
    def bytes_progress(self, description: str) -> Iterator[tuple[Any, Any]]:
        """Yields (on_start(total), on_bytes(n)) callbacks driving a rich bar on stderr."""
        if self.quiet:
            yield (lambda total: None), (lambda n: None)
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TimeRemainingColumn(), console=self.err, transient=True)
        task = progress.add_task(description, total=None)
        with progress:
            yield (lambda total: progress.update(task, total=total)), (lambda n: progress.advance(task, n))


_EXAMPLE = re.compile(r"^(?P<indent>\s*)(?P<command>\S.*?)?(?:\s{2,}(?P<note>\(.*\)))?\s*$")
_WORD = re.compile(r"""(?:"[^"]*"|'[^']*'|\S)+""")


def examples(text: str, width: int = 76) -> str:
    """A help epilog of example commands (click prints it verbatim after `\\b`, indented by 2) fitted to `width`:
    a long command is continued on the next line with ` \\`, its trailing `(note)` goes on a line of its own."""
    fitted: list[str] = []
    command_indent = "  "
    for line in text.splitlines():
        m = _EXAMPLE.match(line)
        if m and m.group("command") and not m.group("command").startswith("("):
            command_indent = m.group("indent")
        if len(line) <= width or m is None:
            fitted.append(line)
            continue
        command, note = m.group("command") or "", m.group("note") or ""
        if command.startswith("(") and not note:
            command, note = "", command
        indent = m.group("indent") if command else command_indent  # a note on a line of its own: its command's
        if command:
            current = indent
            for word in _WORD.findall(command):
                if current.strip() and len(current) + 1 + len(word) > width - 2:
                    fitted.append(current + " \\")
                    current = indent + "    "
                current += (" " if current.strip() else "") + word
            fitted.append(current)
        if note:
            fitted.extend(textwrap.wrap(note, width, initial_indent=indent + "    ",
                                        subsequent_indent=indent + "     "))
    return "\n".join(fitted) + ("\n" if text.endswith("\n") else "")


def _redacted(renderable: Any) -> Any:
    """A cell made with cell() (rich Text) with any credential in it replaced, as every printed text is."""
    plain = getattr(renderable, "plain", None)
    if isinstance(plain, str) and redact(plain) != plain:
        from rich.text import Text

        return Text(redact(plain))
    return renderable


def cell(*lines: object) -> Text:
    """A table cell of several lines: each line shown as plain text (control characters escaped), one per line."""
    from rich.text import Text

    return Text("\n".join(printable(line, lines=False) for line in lines))


def keep_words_whole(console: Console, table: Table, width: int) -> None:
    """Where the table is wider than `width` but every column's longest word fits side by side, fix each column's
    width: its longest word, plus a share of the room left in proportion to what its longest cell needs beyond
    that. Rich, left to shrink the table itself, cuts columns by ratio below a word that a narrower column left
    room for (a model card's bench table went vertical, 64 lines, while its words fit 80 columns)."""
    from rich.measure import Measurement

    wide = console.options.update_width(10**6)
    cells = [[c for c in [column.header if table.show_header else "", *column._cells] if c] for column in table.columns]
    low = [max((_longest(console, wide, c) for c in column), default=1) for column in cells]
    high = [max((Measurement.get(console, wide, c).maximum for c in column), default=1) for column in cells]
    room = width - table._extra_width - (table.padding[1] + table.padding[3]) * len(low)
    if sum(high) <= room or sum(low) > room or any(c.width is not None for c in table.columns):
        return  # fits as it is, or goes vertical (table())
    spare, wants = room - sum(low), [h - lo for h, lo in zip(high, low)]
    shares = [spare * want // sum(wants) for want in wants]
    for column, lo, share in zip(table.columns, low, shares):
        column.width = lo + share


def _longest(console: Console, options: Any, renderable: Any) -> int:
    """The narrowest a cell can be: its longest word, or a command or digest in it (printed whole, never broken)."""
    from rich.measure import Measurement
    from rich.text import Text

    minimum = Measurement.get(console, options, renderable).minimum if renderable else 0
    text = renderable.plain if isinstance(renderable, Text) else renderable if isinstance(renderable, str) else ""
    return max(minimum, longest_unit(text))


def fits(console: Console, table: Table, width: int) -> bool:
    """Whether rich lays `table` out in `width` columns with every word of every cell (and header) whole: each
    column at least as wide as its longest word plus its padding (rich shrinks columns by ratio, and cuts a word
    that does not fit its column with an ellipsis)."""

    wide = console.options.update_width(10**6)

    def longest_word(renderable: Any) -> int:
        return _longest(console, wide, renderable)

    pad = table.padding[1] + table.padding[3]
    needed = [pad + max([longest_word(c.header) if table.show_header else 0, *map(longest_word, c._cells)])
              for c in table.columns]
    try:
        widths = table._calculate_column_widths(console, console.options.update_width(width - table._extra_width))
    except Exception:  # noqa: BLE001 - rich's layout is private: without it, the sum of the minimums decides
        borders = (len(needed) + (1 if table.show_edge else -1)) if table.box else 0
        return sum(needed) + borders <= width
    return all(w >= n for w, n in zip(widths, needed)) and sum(widths) + table._extra_width <= width


def vertical(table: Table, width: int) -> Group:
    """`table` as `label  value` lines: a table with headers gives one block per row (`header  cell`), blocks a blank
    line apart; a table without headers one block (its first cell the label, the others the value). A value wraps
    at spaces; a word longer than the line (a path) is broken after a `/`, as messages are, and folded only where a
    piece is still too long. A digest or a command is never broken: one that does not fit beside its label goes on
    the next line, indented by two."""
    from rich.console import Group
    from rich.text import Text

    headers = [printable(c.header, lines=False) if isinstance(c.header, str) else str(c.header) for c in table.columns]
    cells = zip(*(c._cells for c in table.columns))
    rows = [[c.plain if isinstance(c, Text) else str(c) for c in row] for row in cells]
    if table.show_header and any(headers):
        blocks = [list(zip(headers, row)) for row in rows]
    else:
        blocks = [[(row[0], " ".join(row[1:])) for row in rows]]
    title = table.title.plain if isinstance(table.title, Text) else table.title
    lines: list[str] = wrap_lines(str(title), width, continuation="").splitlines() if title else []
    for i, pairs in enumerate(blocks):
        if i:
            lines.append("")
        label_width = min(max((len(k) for k, _ in pairs), default=1), width // 3)
        for label, value in pairs:
            lines += _pair_lines(label, value, label_width, width)
    return Group(*(Text(line) for line in lines))


def _pair_lines(label: str, value: str, label_width: int, width: int) -> list[str]:
    """`label  value`, the value wrapped in the room beside the label column; a label wider than its column whole
    (its value beside it when the first line fits, else below), a value line too long for the room (a command, a
    digest) whole beneath the label, indented by two."""
    room = max(width - label_width - 2, 1)
    values = wrap_lines(value, room, continuation="").splitlines() if value else []
    indent = " " * (label_width + 2)
    out: list[str] = []
    if len(label) > label_width:
        out.append(label)
        if values and len(label) + 2 + len(values[0]) <= width:
            out[0] += "  " + values.pop(0)
    for n, line in enumerate(values):
        head = label.ljust(label_width) + "  " if n == 0 and not out else indent
        if len(line) > room:
            if n == 0 and not out:
                out.append(label)
            out.append("  " + line)
        else:
            out.append((head + line).rstrip())
    return out or [label]


def quiet_libraries() -> None:
    """flux-port draws its own progress; diffusers' and transformers' per-component bars would bury it.

    Called by the verbs that load those libraries anyway, so that light verbs (recipes, fetch) start fast.
    """
    import os

    if os.environ.get("FLUX_PORT_DEBUG"):
        return
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    for lib in (diffusers_logging, transformers_logging):
        lib.set_verbosity_error()
        lib.disable_progress_bar()


# set by each command once its options are parsed, so main() formats errors in the right mode
current = Output()


def use(json_mode: bool = False, quiet: bool = False, heavy: bool = False) -> Output:
    """Select the output mode; `heavy` verbs (they load diffusers/transformers) also silence those libraries."""
    global current
    current = Output(json_mode, quiet)
    if heavy:
        quiet_libraries()
    return current
