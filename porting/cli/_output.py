"""The one output sink: data to stdout (a rich table, or one JSON document with --json), everything else to stderr."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from porting.finite import dumps
from porting.text import printable


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet or json_mode
        self.documented = False  # --json prints exactly one document
        # tables stay readable when piped or captured (rich assumes 80 columns off a terminal)
        # no emoji codes: a path ending in `:abc:` is a path; no markup in what is printed (see table())
        self.out = Console(file=sys.stdout, highlight=False, emoji=False,
                           width=None if sys.stdout.isatty() else 160)
        self.err = Console(file=sys.stderr, highlight=False, emoji=False,
                           width=None if sys.stderr.isatty() else 160)

    def status(self, text: str) -> None:
        """A progress line for humans (stderr); silent in --quiet and --json."""
        if not self.quiet:
            self.err.print(printable(text, lines=False), markup=False, soft_wrap=True)

    def result(self, text: str) -> None:
        """A line of data for humans (stdout); silent in --json."""
        if not self.json_mode:
            self.out.print(printable(text), markup=False, soft_wrap=True)

    def table(self, table: Table) -> None:
        if not self.json_mode:
            for column in table.columns:  # cells hold key names and paths from files: show control characters
                # and newlines, and print them as plain text ('[b]' or ':abc:' in a path is not markup or emoji)
                column._cells = [Text(printable(c, lines=False)) if isinstance(c, str) else c
                                 for c in column._cells]
            self.out.print(table)

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
        self.err.print(printable(text, lines=lines), markup=False, soft_wrap=True)

    def warning(self, text: str) -> None:
        self.err.print(printable(f"Warning: {text}", lines=False), markup=False, soft_wrap=True)

    def hint(self, text: str) -> None:
        if not self.quiet:
            self.err.print(printable(f"Hint: {text}", lines=False), markup=False, soft_wrap=True)

    @contextmanager
    def bytes_progress(self, description: str) -> Iterator[tuple[Any, Any]]:
        """Yields (on_start(total), on_bytes(n)) callbacks driving a rich bar on stderr."""
        if self.quiet:
            yield (lambda total: None), (lambda n: None)
            return
        progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TimeRemainingColumn(), console=self.err, transient=True)
        task = progress.add_task(description, total=None)
        with progress:
            yield (lambda total: progress.update(task, total=total)), (lambda n: progress.advance(task, n))


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
