"""Streaming safetensors output: shards planned from known shapes, written tensor by tensor, atomically.

The safetensors Python API saves a whole dict at once; a model larger than RAM needs the header first and the
tensor bytes streamed after it, which the format allows because every shape and dtype is known from the plan.
"""

from __future__ import annotations

import collections
import errno
import functools
import hashlib
import itertools
import json
import math
import mmap
import os
import struct
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

if TYPE_CHECKING:
    import torch

from porting.errors import InputError, InternalError, UsageError
from porting.known_digests import remember, shards_record
from porting.outputs import atomic_folder  # noqa: F401  (re-exported: where writers look for it)

from .dtypes import nbytes as _nbytes
from .dtypes import torch_dtype
from .files import FileReader, reader_for
from .identity import WeightsHasher, tensor_bytes
from .prefetch import ByteBudget, prefetched

__all__ = ["Entry", "Segments", "Chunks", "Filled", "WeightsHasher", "write_shards", "plan_shards", "shard_names",
           "parse_size", "atomic_folder"]

ALIGN = 8  # header padded so tensor data starts 8-byte aligned, as safetensors itself does
FOLIO = 64 * 2**10  # copied data keeps its source offset modulo this (see `_folio_twin`)


@dataclass(frozen=True)
class Entry:
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors tag

    @property
    def nbytes(self) -> int:
        return _nbytes(self.shape, self.dtype)


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '10GiB' or a number of bytes."""
    if isinstance(text, int):
        if text < 1:
            raise UsageError(f"--max-shard-size {text}: must be more than 0 bytes.")
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        value = float(num) if num and unit in units else None
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value * units[unit] < 1:
        raise UsageError(f"--max-shard-size {text!r}: not a size; use e.g. 5GB, 500MB or 10GiB (more than 0).")
    return int(value * units[unit])


def plan_shards(entries: list[Entry], max_shard_bytes: int) -> list[list[Entry]]:
    """Greedy sharding in plan order, like diffusers/transformers `save_pretrained`."""
    shards: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if shards[-1] and size + e.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards


def shard_names(stem: str, n: int) -> list[str]:
    if n == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _header_bytes(entries: list[Entry], metadata: dict[str, str] | None, like: int | None = None) -> bytes:
    """The length field and JSON header, padded with spaces so the data starts 8-byte aligned and, where that is
    compatible, at the source offset `like` modulo `FOLIO` (see `_folio_twin`)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    pad = -(len(raw) + 8) % ALIGN
    if like is not None and like % ALIGN == 0:  # the data start stays 8-byte aligned
        pad = (like - len(raw) - 8) % FOLIO
    raw += b" " * pad
    return struct.pack("<Q", len(raw)) + raw


def _folio_twin(piece: object) -> int | None:
    """The source offset the output's data start should match modulo `FOLIO`: that of the shard's first piece when
    it is copied. The page cache holds a file in folios of up to 64 KiB here (aligned in the file), and the kernel
    copies a range folio to folio only where source and destination share their offset within one: the same
    1.37 GB warm copy took 0.38 s so, 0.47 s shifted by one 4 KiB page and 0.44 s by 16 KiB. A convert copies long
    runs of adjacent tensors, so matching the first keeps the runs after it matched too. The padding (spaces after
    the JSON, which the format allows) is at most 64 KiB."""
    if isinstance(piece, Segments) and piece.parts:
        return piece.parts[0][1]
    return None


@dataclass(frozen=True)
class Segments:
    """An output tensor whose bytes are byte ranges of source files, in order: `(file, offset, length)`.

    Renames, row splits, row concatenations and half swaps along dim 0 without a dtype change only move whole rows
    of a row-major tensor, so the writer copies those bytes without torch, a piece at a time (see `write_shards`).
    """

    parts: tuple[tuple[Path, int, int], ...]
    source_key: str  # for error messages

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.parts)


@dataclass(frozen=True)
class Chunks:
    """An output tensor computed in consecutive row blocks (e.g. dequantized), written as the blocks come.

    Keeps memory at a few blocks for tensors that cannot be copied as bytes; the blocks are computed on the
    writer's reading thread while the last ones are written and hashed.
    """

    blocks: Iterable[torch.Tensor]
    source_key: str  # for error messages


@dataclass(frozen=True)
class Filled:
    """An output tensor of `rows` rows of `row_bytes` bytes that the producer writes straight into the writer's
    buffers: `fill(view, a, b)` puts the bytes of rows [a, b) into `view`, a buffer the writer reuses once written.

    For tensors computed a few rows at a time (merged weights): no allocation per tensor or per block, and the
    bytes are written and hashed from the same buffers as copied tensors.
    """

    rows: int
    row_bytes: int
    fill: Callable[[memoryview, int, int], None]
    source_key: str  # for error messages

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes


READ_PIECE = 16 * 2**20  # bytes per buffer of a tensor computed or filled in memory
READ_AHEAD = 96 * 2**20  # bytes computed ahead of the writer at most, beyond one piece
HASH_ASIDE = 2**20  # pieces this large are hashed on a third thread while being written; smaller ones inline
HASH_PIECE = 2**20  # bytes per read of a copied tensor's hash: small enough to stay in the CPU cache while hashed
HASH_BEHIND = 512 * 2**20  # copied bytes whose hash may still be pending before the copying waits for it
COPY_MAX = 16 * 2**20  # bytes per copy_file_range call: small enough that the file digest reads them back from the
# CPU cache right after (`_FileDigest`; with 256 MiB calls the same warm convert took 1.05 s instead of 0.98 s), and
# progress is reported after each


class _Sources:
    """The source files' readers (files.reader_for: the descriptor opened when each header was read), asked for a
    larger read-ahead (what cp asks for)."""

    def __init__(self) -> None:
        self._readers: dict[Path, FileReader] = {}

    def reader(self, path: Path) -> FileReader:
        if path not in self._readers:
            self._readers[path] = reader_for(path)
            self._readers[path].advise(0, 0, "sequential")
        return self._readers[path]

    def fd(self, path: Path) -> int:
        return self.reader(path).fd

    def read_into(self, view: memoryview, path: Path, offset: int, key: str) -> int:
        n = os.preadv(self.fd(path), [view], offset)
        if n == 0:
            raise InputError(f"{path}: unexpected end of file while reading tensor {key!r}.")
        return n

    def close(self) -> None:
        self._readers.clear()  # the descriptors belong to the readers; the last holder closes them


Piece = tuple[memoryview, "mmap.mmap | None"]  # bytes of a tensor, and the read buffer they live in (if any)


class _Copier:
    """Copies `Segments` into the output inside the kernel (`copy_file_range`, what cp does): the bytes go page cache
    to page cache, never out to this process and back, which made a convert from a warm page cache several times
    slower than cp. Where the kernel cannot (another file system, an old kernel) the bytes are read and written.

    Ranges that continue the one before in the same source (a convert's renames and row splits, mostly) are
    gathered into one run and copied with as few calls as possible: cut at each tensor, the same 1.37 GB copy took
    0.42 s against 0.35 s in one call. `flush` copies the gathered run; the writer calls it before writing anything
    else to the file and before closing it."""

    UNSUPPORTED = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}

    def __init__(self, on_bytes: Callable[[int], None] | None = None) -> None:
        self.sources = _Sources()
        self.kernel = hasattr(os, "copy_file_range")
        self.on_bytes = on_bytes  # told the bytes of each call once copied
        self._buffer: memoryview | None = None
        self._run: list[tuple[Path, int, int, str]] = []  # adjacent parts not yet copied, with their tensor

    def copy(self, out_fd: int, item: Segments) -> None:
        for path, offset, length in item.parts:
            if self._run:
                last_path, last_offset, last_length, _ = self._run[-1]
                if last_path != path or last_offset + last_length != offset:
                    self.flush(out_fd)
            self._run.append((path, offset, length, item.source_key))
            while sum(n for _, _, n, _ in self._run) >= COPY_MAX:  # a long run is copied as it grows
                self.flush(out_fd, COPY_MAX)

    def flush(self, out_fd: int, most: int | None = None) -> None:
        """Copy the gathered run, or its first `most` bytes (the rest stays gathered)."""
        if not self._run:
            return
        path, start = self._run[0][0], self._run[0][1]
        length = sum(n for _, _, n, _ in self._run)
        length = length if most is None else min(most, length)
        self._copy(out_fd, path, start, length)
        end = start + length
        rest = [(p, max(o, end), o + n - max(o, end), k) for p, o, n, k in self._run if o + n > end]
        self._run = rest

    def _key_at(self, offset: int) -> str:
        """The tensor whose bytes lie at `offset` of the run (for errors)."""
        return next((key for _, start, n, key in self._run if offset < start + n), self._run[-1][3])

    def _copy(self, out_fd: int, path: Path, offset: int, length: int) -> None:
        done = 0
        while self.kernel and done < length:
            try:
                n = os.copy_file_range(self.sources.fd(path), out_fd, min(length - done, COPY_MAX), offset + done)
            except OSError as e:
                if e.errno not in self.UNSUPPORTED:
                    raise
                self.kernel = False
                break
            if n == 0:
                key = self._key_at(offset + done)
                raise InputError(f"{path}: unexpected end of file while reading tensor {key!r}.")
            done += n
            self._copied(n)
        while done < length:
            if self._buffer is None:
                self._buffer = memoryview(mmap.mmap(-1, READ_PIECE))
            n = self.sources.read_into(self._buffer[:min(READ_PIECE, length - done)], path, offset + done,
                                       self._key_at(offset + done))
            _write_all(out_fd, self._buffer[:n])
            done += n
            self._copied(n)

    def _copied(self, n: int) -> None:
        if self.on_bytes:
            self.on_bytes(n)

    def close(self) -> None:
        self._run.clear()
        self.sources.close()


KnownDigests = Mapping[Path, Mapping[tuple[int, int], str]]  # source file -> (start, length) -> sha256 of those bytes


class _SideHashes:
    """The sha256 of copied tensors, read back from their source ranges (in the page cache: the copy just read them,
    or is about to) on two threads: tensors are hashed in parallel while later ones are copied. A range whose
    digest is `known` (port fetch took it while verifying the file) is not read again."""

    def __init__(self, hasher: WeightsHasher | None, known: KnownDigests | None = None, defer: bool = False) -> None:
        self.hasher = hasher
        self.known = known or {}
        self.defer = defer  # a copied tensor whose digest is not known is not hashed here (hasher.defer)
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="flux-port-hash") if hasher else None
        self.local = threading.local()
        self.opened: list[_Sources] = []
        self.pending: collections.deque[tuple[Future, int]] = collections.deque()
        self.bytes_pending = 0

    def submit(self, e: Entry, item: Segments, before_waiting: Callable[[], None] | None = None) -> None:
        """Hash `item` on the side; `before_waiting` runs first if this must wait for earlier hashes (the writer
        copies what it gathered, so the copy is not left waiting on hashes)."""
        if self.pool is None or self.hasher is None:
            return
        if len(item.parts) == 1:  # a whole stored tensor copied as it is: its digest may be known already
            path, offset, length = item.parts[0]
            digest = self.known.get(path, {}).get((offset, length))
            if digest is not None:
                self.hasher.add(e.key, e.dtype, e.shape, digest)
                return
        if self.defer:
            self.hasher.defer(e.key)
            return
        while self.pending and self.bytes_pending + item.nbytes > HASH_BEHIND:
            if before_waiting is not None:
                before_waiting()
                before_waiting = None
            self._wait_one()
        self.pending.append((self.pool.submit(self._hash, e, item), item.nbytes))
        self.bytes_pending += item.nbytes

    def _hash(self, e: Entry, item: Segments) -> None:
        sources, buf = getattr(self.local, "state", (None, None))
        if sources is None:
            sources, buf = _Sources(), memoryview(bytearray(HASH_PIECE))
            self.local.state = (sources, buf)
            self.opened.append(sources)
        digest = hashlib.sha256()
        for path, offset, length in item.parts:
            done = 0
            while done < length:
                n = sources.read_into(buf[:min(HASH_PIECE, length - done)], path, offset + done, item.source_key)
                digest.update(buf[:n])
                done += n
        assert self.hasher is not None
        self.hasher.add(e.key, e.dtype, e.shape, digest.hexdigest())

    def _wait_one(self) -> None:
        future, nbytes = self.pending.popleft()
        self.bytes_pending -= nbytes
        future.result()

    def finish(self) -> None:
        while self.pending:
            self._wait_one()

    def close(self) -> None:
        if self.pool is not None:
            for future, _ in self.pending:
                future.cancel()
            self.pool.shutdown()
        for sources in self.opened:
            sources.close()


def _pieces(entries: list[Entry], items: Iterable[torch.Tensor | Segments | Chunks | Filled], budget: ByteBudget,
            pool: list[mmap.mmap]) -> Iterator[Piece | Segments | None]:
    """The bytes of every planned tensor in order, checked against the plan; None after each tensor.

    Runs on the writer's second thread. Copied tensors (`Segments`) are handed on for the writer to copy; tensors
    filled in memory use reusable buffers from `pool`; every piece is taken from `budget` first, so memory ahead of
    the writer stays bounded.
    """
    it = iter(items)
    try:
        for e in entries:
            _leave_cores_to_the_writer()
            item = next(it, None)
            if item is None:
                raise InternalError(f"the tensors ran out before {e.key!r}, which the plan has.")
            if isinstance(item, Segments):
                if item.nbytes != e.nbytes:
                    raise InternalError(f"tensor {e.key!r} came out as {item.nbytes} bytes, planned {e.nbytes}.")
                yield item
            elif isinstance(item, Filled):
                yield from _filled_pieces(e, item, budget, pool)
            elif isinstance(item, Chunks):
                yield from _computed_pieces(e, item.blocks, budget, whole=False)
            else:
                yield from _computed_pieces(e, (item,), budget, whole=True)
            if budget.closed:  # the writer stopped
                return
            yield None
    finally:
        close = getattr(it, "close", None)
        if close is not None:  # the tensors' producer (merge's open files) ends on this thread
            close()


def _filled_pieces(e: Entry, item: Filled, budget: ByteBudget, pool: list[mmap.mmap]) -> Iterator[Piece]:
    if item.nbytes != e.nbytes:
        raise InternalError(f"tensor {e.key!r} came out as {item.nbytes} bytes, planned {e.nbytes}.")
    step = max(1, READ_PIECE // max(item.row_bytes, 1))
    for a in range(0, item.rows, step):
        b = min(a + step, item.rows)
        want = (b - a) * item.row_bytes
        buf = pool.pop() if pool else mmap.mmap(-1, max(READ_PIECE, want))
        if len(buf) < want:  # a row larger than a piece (none in these models): a buffer of its own
            pool.append(buf)
            buf = mmap.mmap(-1, want)
        if not budget.take(want):
            return
        view = memoryview(buf)[:want]
        item.fill(view, a, b)
        yield view, buf


def _computed_pieces(e: Entry, blocks: Iterable[torch.Tensor], budget: ByteBudget, whole: bool) -> Iterator[Piece]:
    """In-memory tensors: one `whole` tensor, or consecutive row blocks of it."""
    written = 0
    for block in blocks:
        fits = tuple(block.shape) == e.shape if whole else tuple(block.shape[1:]) == e.shape[1:]
        if torch_dtype(e.dtype) != block.dtype or not fits:
            raise InternalError(f"tensor {e.key!r} came out as {list(block.shape)} {block.dtype}, planned "
                                f"{'' if whole else 'rows of '}{list(e.shape)} {e.dtype}.")
        data = tensor_bytes(block)
        if not budget.take(data.nbytes):
            return
        yield data, None
        written += data.nbytes
    if written != e.nbytes:
        raise InternalError(f"tensor {e.key!r} came out as {written} bytes, planned {e.nbytes}.")


def _leave_cores_to_the_writer() -> None:
    """Limit torch's intra-op threads on this (the producing) thread to the cores the writer and hasher leave.

    torch's OpenMP workers spin for a while after each operation; on two cores they took the writer's and hasher's
    CPU and made a GGUF klein-9B convert a third slower. The setting is per thread, so the caller's stays as it was.
    torch is only touched when something already imported it: a plain byte copy stays torch-free.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        want = max(1, cores - 2)
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)


DROP_BEHIND = 1 << 30  # written bytes further back than this are dropped from the page cache once written back


class _DropBehind:
    """Drops the pages of a file being written from the page cache once they lie `DROP_BEHIND` bytes behind the end
    (pages still dirty stay: the kernel skips them), for bytes written from this process's buffers (computed tensors:
    a merge). The page cache then recycles the same pages instead of growing over the whole output: growing it made
    the kernel's copy of each written byte (`copy_folio_from_iter_atomic`, half of a merge's CPU in `perf`) several
    times slower on the 2-core VM; a klein-9B-shaped 4.2 GB merge took 6 s of system time with this, 17-21 s
    without (docs/adapters.md). Bytes copied file to file (`Segments`) are left to the kernel, as cp leaves them."""

    def __init__(self, start: int) -> None:
        self.end = start
        self.dropped = 0

    def wrote(self, fd: int, n: int) -> None:
        self.end += n
        upto = self.end - DROP_BEHIND
        if upto - self.dropped >= DROP_BEHIND // 4 and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, self.dropped, upto - self.dropped, os.POSIX_FADV_DONTNEED)
            self.dropped = upto


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


@dataclass
class _ShardRun:
    """What writing each tensor of a shard shares: the copier, the side hashes, the hashing thread, the read-ahead
    budget and its buffer pool, the weights hasher and the progress callback."""

    copier: _Copier
    side: _SideHashes
    hashing: ThreadPoolExecutor
    budget: ByteBudget
    pool: list[mmap.mmap]
    hasher: WeightsHasher | None
    on_bytes: Callable[[int], None] | None

    def write_entry(self, e: Entry, pieces: Iterator[Any], out_fd: int, behind: _DropBehind) -> None:
        """Write one tensor's pieces (up to its None): copied ranges by the kernel, hashed on the side; bytes from
        memory written while a third thread hashes them."""
        digest = hashlib.sha256() if self.hasher else None
        copied = False
        while (piece := next(pieces)) is not None:
            if isinstance(piece, Segments):  # copied by the kernel, hashed on the side
                self.side.submit(e, piece, before_waiting=functools.partial(self.copier.flush, out_fd))
                self.copier.copy(out_fd, piece)
                digest, copied = None, True
                continue
            self.copier.flush(out_fd)  # the copied bytes before these go first
            data, buf = piece
            hashed = None
            if digest and data.nbytes >= HASH_ASIDE:  # the hash runs on a third thread as we write
                hashed = self.hashing.submit(digest.update, data)
            elif digest:
                digest.update(data)
            _write_all(out_fd, data)
            behind.wrote(out_fd, data.nbytes)
            if hashed:
                hashed.result()
            self.budget.give(data.nbytes)
            del data, piece
            if buf is not None:
                self.pool.append(buf)
        if self.hasher and digest is not None:
            self.hasher.add(e.key, e.dtype, e.shape, digest.hexdigest())
        if self.on_bytes and not copied:  # copied bytes are reported by the copier as it copies them
            self.on_bytes(e.nbytes)


def write_shards(folder: Path, stem: str, entries: list[Entry],
                 tensors: Iterable[torch.Tensor | Segments | Chunks | Filled],
                 max_shard_bytes: int, metadata: dict[str, str] | None = None,
                 on_bytes: Callable[[int], None] | None = None,
                 hasher: WeightsHasher | None = None, known: KnownDigests | None = None,
                 defer: bool = False) -> list[str]:
    """Write `tensors` (yielded in the order of `entries`) as one file or shards plus the standard index.

    An item is a tensor (written from memory), `Segments` (byte ranges of source files, copied), `Chunks` (row
    blocks computed one after another) or `Filled` (rows the producer writes into the writer's buffers).

    With `hasher` (the weights identity), `Segments` are copied file to file by the kernel while two side threads
    hash the same source ranges (from the page cache), except the whole tensors whose digest is `known` (source
    file -> (start, length) -> sha256: port fetch took it); tensors in memory are computed on a second thread while
    this one writes the last pieces and a third hashes them. With `defer`, a copied tensor whose digest is not known
    is not hashed (the hasher is then not `complete`: the weights identity is left to the first verb that certifies
    the weights, validate). Each shard's record (`porting.known_digests`) holds each tensor's sha256 by its byte
    range in the shard, and the weights identity of the set when complete. No file's own sha256 is taken here: the
    first verb that certifies the file takes it (publish, push), so a convert costs what the copy costs.
    """
    shards = plan_shards(entries, max_shard_bytes)
    names = shard_names(stem, len(shards))
    weight_map: dict[str, str] = {}
    budget = ByteBudget(READ_AHEAD)
    pool: list[mmap.mmap] = []
    stream = prefetched(_pieces(entries, tensors, budget, pool), depth=64)
    hashing = ThreadPoolExecutor(1, thread_name_prefix="flux-port-hash")
    copier, side = _Copier(on_bytes), _SideHashes(hasher, known, defer)
    run = _ShardRun(copier, side, hashing, budget, pool, hasher, on_bytes)
    written: dict[str, tuple[os.stat_result, int]] = {}  # each shard as closed, and where its data starts
    try:
        for name, shard in zip(names, shards):
            with open(folder / name, "wb", buffering=0) as f:
                out_fd = f.fileno()
                first = next(stream) if shard else None  # seen before the header, padded to its place in a page
                pieces = itertools.chain((first,), stream)
                header = _header_bytes(shard, metadata, _folio_twin(first))
                _write_all(out_fd, header)
                behind = _DropBehind(len(header))
                for e in shard:
                    run.write_entry(e, pieces, out_fd, behind)
                    weight_map[e.key] = name
                copier.flush(out_fd)
            written[name] = (os.stat(folder / name), len(header))
            side.finish()  # every hash of this shard is taken before the next shard (and before returning)
    finally:
        budget.close()  # a producer waiting for room returns, so closing the stream can join it
        stream.close()
        hashing.shutdown()
        side.close()
        copier.close()
    if hasher is not None:
        _remember_shards(folder, zip(names, shards), written, hasher)
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def _remember_shards(folder: Path, shards: Iterable[tuple[str, list[Entry]]],
                     written: Mapping[str, tuple[os.stat_result, int]], hasher: WeightsHasher) -> None:
    """Each shard's record: the weights identity of the set (when every tensor's digest was taken), and each
    tensor's sha256 by its byte range in it."""
    weights = shards_record(hasher.hexdigest(), list(written)) if hasher.complete else None
    for name, shard in shards:
        st, offset = written[name]
        tensors: dict[tuple[int, int], str] = {}
        for e in shard:
            digest = hasher.digest(e.key)
            if digest is not None:
                tensors[(offset, e.nbytes)] = digest
            offset += e.nbytes
        remember(folder / name, weights=weights, expect=st, tensors=tensors)
