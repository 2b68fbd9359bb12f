"""One rich display for a fetch (total bytes + the current file), fed by both clients' progress hooks."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class FetchProgress:
    """`with FetchProgress(console, total) as p: with p.file(name, size, have) as bar: bar.update(n)`.

    With console=None (--quiet, --json) every call is a no-op.
    """

    def __init__(self, console: Console | None, total_bytes: int) -> None:
        self._progress = None if console is None else Progress(
            TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True)
        self._total: TaskID | None = None
        self._total_bytes = total_bytes

    def __enter__(self) -> "FetchProgress":
        if self._progress is not None:
            self._progress.start()
            self._total = self._progress.add_task("total", total=self._total_bytes)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.stop()

    def file(self, name: str, size: int, have: int = 0, counts: bool = True) -> "FileBar":
        """A bar for one file; `counts=False` for work that does not add to the total (hashing)."""
        return FileBar(self, name, size, have, counts)


class FileBar:
    def __init__(self, owner: FetchProgress, name: str, size: int, have: int, counts: bool) -> None:
        self._owner = owner
        self._name = name if len(name) <= 48 else "…" + name[-47:]
        self._size = size
        self._have = have
        self._counts = counts
        self._task: TaskID | None = None

    def __enter__(self) -> "FileBar":
        p = self._owner._progress
        if p is not None:
            self._task = p.add_task(self._name, total=self._size, completed=self._have)
        return self

    def __exit__(self, *exc: Any) -> None:
        p = self._owner._progress
        if p is not None and self._task is not None:
            p.remove_task(self._task)

    def update(self, n: int) -> None:
        p = self._owner._progress
        if p is None or self._task is None or not n:
            return
        p.advance(self._task, n)
        if self._counts and self._owner._total is not None:
            p.advance(self._owner._total, n)

    def tqdm_class(self) -> type:
        """A stand-in for tqdm that huggingface_hub's http_get drives (update(n), also negative, as a context)."""
        bar = self

        class _Bar:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                pass

            def __enter__(self) -> "_Bar":
                return self

            def __exit__(self, *exc: Any) -> None:
                return None

            def update(self, n: int = 1) -> None:
                bar.update(n)

            def close(self) -> None:
                pass

        return _Bar

    def ms_callback_class(self, base: type) -> type:
        """A modelscope_hub ProgressCallback subclass reporting into this bar (instantiated by the client)."""
        bar = self

        class _Callback(base):  # type: ignore[misc, valid-type]
            def __init__(self, filename: str, file_size: int) -> None:
                super().__init__(filename, file_size)

            def update(self, size: int) -> None:
                bar.update(size)

            def end(self) -> None:
                pass

        return _Callback
