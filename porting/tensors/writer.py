"""Streaming safetensors output: shards planned from known shapes, written tensor by tensor, atomically.

The safetensors Python API saves a whole dict at once; a model larger than RAM needs the header first and the
tensor bytes streamed after it, which the format allows because every shape and dtype is known from the plan.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
import queue
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

if TYPE_CHECKING:
    import torch

from porting.errors import InputError, InternalError, UsageError
from porting.outputs import atomic_folder  # noqa: F401  (re-exported: where writers look for it)

from .dtypes import nbytes as _nbytes
from .dtypes import torch_dtype
from .identity import WeightsHasher, tensor_bytes

__all__ = ["Entry", "Segments", "Chunks", "WeightsHasher", "write_shards", "plan_shards", "shard_names", "parse_size",
           "atomic_folder"]

ALIGN = 8  # header padded so tensor data starts 8-byte aligned, as safetensors itself does
PAGE = 4096


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


def _header_bytes(entries: list[Entry], metadata: dict[str, str] | None, page_residue: int | None = None) -> bytes:
    """The length field and JSON header, padded with spaces so the data starts 8-byte aligned.

    With `page_residue`, the padding also puts the data start at that offset modulo the page size: when the first
    tensor is copied from a source file where it starts at the same residue, source and destination pages line up,
    which makes the kernel's file-to-file copy markedly faster.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    pad = -(len(raw) + 8) % ALIGN
    if page_residue is not None and page_residue % ALIGN == 0:
        pad = (page_residue - (len(raw) + 8)) % PAGE
    raw += b" " * pad
    return struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class Segments:
    """An output tensor whose bytes are byte ranges of source files, in order: `(file, offset, length)`.

    Renames, row splits, row concatenations and half swaps along dim 0 without a dtype change only move whole rows
    of a row-major tensor, so the writer can copy those bytes file to file (`os.copy_file_range`, the kernel-side
    copy `cp` uses) instead of reading them into memory and writing them back; `SegmentHasher` hashes them.
    """

    parts: tuple[tuple[Path, int, int], ...]
    source_key: str  # for error messages

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.parts)


@dataclass(frozen=True)
class Chunks:
    """An output tensor computed in consecutive row blocks (e.g. dequantized), written as the blocks come.

    Keeps memory at one block for tensors that cannot be copied as bytes; hashed like `Segments`, from the output
    file on the second thread.
    """

    blocks: Iterable[torch.Tensor]
    source_key: str  # for error messages


CHUNK = 8 * 2**20  # bytes per pread call (copy_file_range is asked for a whole tensor at once: large calls are faster)


class _Copier:
    """Copies `Segments` into an output file descriptor, kernel-side when the platform allows."""

    def __init__(self) -> None:
        self.kernel_copy = hasattr(os, "copy_file_range")
        self._fds: dict[Path, int] = {}
        self._buf = bytearray(0)

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
            if hasattr(os, "posix_fadvise"):  # larger read-ahead, as cp asks for
                os.posix_fadvise(self._fds[path], 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return self._fds[path]

    def copy(self, seg: Segments, out_fd: int) -> None:
        for path, offset, length in seg.parts:
            src, done = self.fd(path), 0
            while done < length:
                n = self._copy_chunk(src, out_fd, length - done, offset + done)
                if n == 0:
                    raise InputError(f"{path}: unexpected end of file while reading tensor {seg.source_key!r}.")
                done += n

    def _copy_chunk(self, src: int, dst: int, count: int, offset: int) -> int:
        if self.kernel_copy:
            try:
                return os.copy_file_range(src, dst, count, offset)
            except OSError as e:  # another filesystem, an old kernel: fall back to plain reads and writes
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                    raise
                self.kernel_copy = False
        count = min(count, CHUNK)
        if len(self._buf) < count:
            self._buf = bytearray(count)
        view = memoryview(self._buf)[:count]
        n = os.preadv(src, [view], offset)
        _write_all(dst, view[:n])
        return n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


HASH_WINDOW = 64 * 2**20  # bytes of the output file mapped at a time while hashing


def _hash_file_range(fd: int, offset: int, length: int) -> str:
    """sha256 of bytes [offset, offset + length) of a file, read through small memory maps (no copies)."""
    h = hashlib.sha256()
    pos, end = offset, offset + length
    while pos < end:
        base = pos - pos % mmap.ALLOCATIONGRANULARITY
        n = min(HASH_WINDOW, end - pos)
        with mmap.mmap(fd, pos - base + n, access=mmap.ACCESS_READ, offset=base) as m, memoryview(m) as view:
            h.update(view[pos - base:pos - base + n])
        pos += n
    return h.hexdigest()


class SegmentHasher:
    """Hashes copied tensors on a second thread, from the output file the main thread has just written.

    The bytes are still in the page cache and are hashed through memory maps, so hashing costs no copy and runs on
    another core while the kernel copies the next tensor (hashlib releases the GIL). Only this process writes the
    staging file, and only ranges already written are hashed, so the maps never outlive their data. The short queue
    keeps the hasher close behind the copy.
    """

    def __init__(self, hasher: WeightsHasher) -> None:
        self.hasher = hasher
        self.jobs: queue.Queue = queue.Queue(maxsize=4)
        self.error: BaseException | None = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="flux-port-hasher", daemon=True)
        self.thread.start()

    def submit(self, key: str, dtype: str, shape: tuple[int, ...], path: Path, offset: int, length: int) -> None:
        while True:
            self._raise_error()
            try:
                self.jobs.put((key, dtype, shape, path, offset, length), timeout=0.5)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        """Wait until every submitted tensor is hashed; re-raise the hasher's error if it had one."""
        self.jobs.put(None)
        self.thread.join()
        self._raise_error()

    def stop(self) -> None:
        self.stopped.set()
        try:
            self.jobs.put_nowait(None)
        except queue.Full:
            pass
        self.thread.join()

    def _raise_error(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        fds: dict[Path, int] = {}
        try:
            while not self.stopped.is_set():
                job = self.jobs.get()
                if job is None:
                    return
                key, dtype, shape, path, offset, length = job
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                self.hasher.add(key, dtype, shape, _hash_file_range(fds[path], offset, length))
        except BaseException as e:  # reported to the main thread by submit() / finish()
            self.error = e
        finally:
            for fd in fds.values():
                os.close(fd)


def write_shards(folder: Path, stem: str, entries: list[Entry], tensors: Iterable[torch.Tensor | Segments | Chunks],
                 max_shard_bytes: int, metadata: dict[str, str] | None = None,
                 on_bytes: Callable[[int], None] | None = None,
                 hasher: WeightsHasher | None = None) -> list[str]:
    """Write `tensors` (yielded in the order of `entries`) as one file or shards plus the standard index.

    An item is a tensor (written from memory), `Segments` (copied file to file and hashed on a second thread) or
    `Chunks` (row blocks written from memory and hashed on the second thread).
    """
    shards = plan_shards(entries, max_shard_bytes)
    names = shard_names(stem, len(shards))
    it = iter(tensors)
    weight_map: dict[str, str] = {}
    copier = _Copier()
    background: SegmentHasher | None = None
    try:
        for name, shard in zip(names, shards):
            first = next(it)
            # copied tensors keep their offset modulo the page size when the shard's data start matches the source
            residue = first.parts[0][1] % PAGE if isinstance(first, Segments) and first.parts else None
            with open(folder / name, "wb", buffering=0) as f:
                out_fd = f.fileno()
                _write_all(out_fd, _header_bytes(shard, metadata, residue))
                for i, e in enumerate(shard):
                    item = first if i == 0 else next(it)
                    if isinstance(item, Segments):
                        if item.nbytes != e.nbytes:
                            raise InternalError(f"tensor {e.key!r} came out as {item.nbytes} bytes, "
                                                f"planned {e.nbytes}.")
                        position = os.lseek(out_fd, 0, os.SEEK_CUR)
                        copier.copy(item, out_fd)
                        if hasher:
                            background = background or SegmentHasher(hasher)
                            background.submit(e.key, e.dtype, e.shape, folder / name, position, e.nbytes)
                    elif isinstance(item, Chunks):
                        position = os.lseek(out_fd, 0, os.SEEK_CUR)
                        written = 0
                        for block in item.blocks:
                            if torch_dtype(e.dtype) != block.dtype or tuple(block.shape[1:]) != e.shape[1:]:
                                raise InputError(f"internal: a block of tensor {e.key!r} came out as "
                                                 f"{list(block.shape)} {block.dtype}, planned rows of "
                                                 f"{list(e.shape)} {e.dtype}.")
                            data = tensor_bytes(block)
                            _write_all(out_fd, data)
                            written += data.nbytes
                        if written != e.nbytes:
                            raise InputError(f"internal: tensor {e.key!r} came out as {written} bytes, planned "
                                             f"{e.nbytes}.")
                        if hasher:
                            background = background or SegmentHasher(hasher)
                            background.submit(e.key, e.dtype, e.shape, folder / name, position, e.nbytes)
                    else:
                        t = item
                        if tuple(t.shape) != e.shape or torch_dtype(e.dtype) != t.dtype:
                            raise InternalError(f"tensor {e.key!r} came out as {list(t.shape)} {t.dtype}, "
                                                f"planned {list(e.shape)} {e.dtype}.")
                        _write_all(out_fd, tensor_bytes(t))
                        if hasher:
                            hasher.update(e.key, t, e.dtype)
                    if on_bytes:
                        on_bytes(e.nbytes)
                    weight_map[e.key] = name
        if background:
            background.finish()
            background = None
    finally:
        copier.close()
        if background:
            background.stop()
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names
