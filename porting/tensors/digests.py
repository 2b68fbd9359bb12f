"""The sha256 of each tensor's bytes, taken while a file is read front to back for another reason (port fetch's
verification), so that the weights identity of a byte-for-byte copy of those tensors needs no pass of its own.

The digests are keyed by byte range `(start, length)` of the file, as the writer's copies (`Segments`) name them.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterable

from porting.errors import PortError

Range = tuple[int, int]  # (absolute start, length) in bytes
EMPTY = hashlib.sha256(b"").hexdigest()


class RangeDigests:
    """sha256 of byte ranges of one file, fed the file's bytes in order (`feed(offset, block)`, offsets increasing).

    Ranges that overlap (no valid safetensors file has them) switch the digests off: `digests` stays empty.
    """

    def __init__(self, ranges: Iterable[Range]) -> None:
        self._ranges = sorted(r for r in ranges if r[1] > 0)
        self.digests: dict[Range, str] = {r: EMPTY for r in ranges if r[1] == 0}
        if any(a[0] + a[1] > b[0] for a, b in zip(self._ranges, self._ranges[1:])):
            self._ranges, self.digests = [], {}
        self._i = 0
        self._open: hashlib._Hash | None = None

    def feed(self, offset: int, block: bytes | memoryview) -> None:
        view, end = memoryview(block), offset + len(block)
        while self._i < len(self._ranges):
            start, length = self._ranges[self._i]
            stop = start + length
            if start >= end:
                return
            if self._open is None:
                self._open = hashlib.sha256()
            self._open.update(view[max(start, offset) - offset:min(stop, end) - offset])
            if stop > end:
                return
            self.digests[(start, length)] = self._open.hexdigest()
            self._open = None
            self._i += 1

    def done(self) -> dict[Range, str]:
        """The digests of every range fed whole."""
        return dict(self.digests)


def safetensors_ranges(path: Path) -> list[Range] | None:
    """The byte range of every tensor in a safetensors file, from its header; None when the header does not parse
    (not a safetensors file, or a damaged one: its own verification, not this, reports it)."""
    from .checkpoint import read_header

    try:
        infos, _ = read_header(path)
    except PortError:
        return None
    return [(i.start, i.nbytes) for i in infos.values()]


class BesideDigests:
    """`RangeDigests` fed on a thread of its own, so the per-tensor hashes run on another core than the caller's
    (hashlib releases the GIL for large buffers). `feed` hands a block over and returns; `done` waits."""

    def __init__(self, ranges: Iterable[Range]) -> None:
        self._digests = RangeDigests(ranges)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flux-port-tensor-hash")
        self._last: Future | None = None

    def feed(self, offset: int, block: bytes) -> None:
        if self._last is not None:
            self._last.result()  # one block in flight: memory stays at one block beyond the caller's
        self._last = self._pool.submit(self._digests.feed, offset, block)

    def done(self) -> dict[Range, str]:
        if self._last is not None:
            self._last.result()
        return self._digests.done()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
