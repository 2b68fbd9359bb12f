"""Streaming safetensors output: shards planned from known shapes, written tensor by tensor, atomically.

The safetensors Python API saves a whole dict at once; a model larger than RAM needs the header first and the
tensor bytes streamed after it, which the format allows because every shape and dtype is known from the plan.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from .checkpoint import ST_TO_TORCH
from .errors import InputError, OutputExistsError

ALIGN = 8  # header padded so tensor data starts 8-byte aligned, as safetensors itself does


@dataclass(frozen=True)
class Entry:
    key: str
    shape: tuple[int, ...]
    dtype: str  # safetensors tag

    @property
    def nbytes(self) -> int:
        n = ST_TO_TORCH[self.dtype].itemsize
        for s in self.shape:
            n *= s
        return n


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '10GiB' or a number of bytes."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    if not num or unit not in units:
        raise ValueError(f"cannot read size {text!r}; use e.g. 5GB, 500MB or 10GiB")
    return int(float(num) * units[unit])


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


def _header_bytes(entries: list[Entry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % ALIGN)
    return struct.pack("<Q", len(raw)) + raw


class WeightsHasher:
    """Identity of a set of weights, independent of file layout and tensor order.

    sha256 over the sorted lines `key|dtype|shape|sha256(bytes)`; `hash_checkpoint` recomputes it from files, so
    validate and publish can prove they look at the weights convert wrote.
    """

    def __init__(self) -> None:
        self._lines: dict[str, str] = {}

    def update(self, key: str, tensor: torch.Tensor, dtype: str) -> None:
        digest = hashlib.sha256(_as_bytes(tensor)).hexdigest()
        self._lines[key] = f"{key}|{dtype}|{list(tensor.shape)}|{digest}\n"

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for key in sorted(self._lines):
            h.update(self._lines[key].encode())
        return h.hexdigest()


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    t = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def write_shards(folder: Path, stem: str, entries: list[Entry], tensors: Iterable[torch.Tensor],
                 max_shard_bytes: int, metadata: dict[str, str] | None = None,
                 on_bytes: Callable[[int], None] | None = None,
                 hasher: WeightsHasher | None = None) -> list[str]:
    """Write `tensors` (yielded in the order of `entries`) as one file or shards plus the standard index."""
    shards = plan_shards(entries, max_shard_bytes)
    names = shard_names(stem, len(shards))
    it = iter(tensors)
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        with open(folder / name, "wb") as f:
            f.write(_header_bytes(shard, metadata))
            for e in shard:
                t = next(it)
                if tuple(t.shape) != e.shape or ST_TO_TORCH[e.dtype] != t.dtype:
                    raise InputError(f"internal: tensor {e.key!r} came out as {list(t.shape)} {t.dtype}, planned "
                                     f"{list(e.shape)} {e.dtype}.")
                data = _as_bytes(t)
                f.write(data)
                if hasher:
                    hasher.update(e.key, t, e.dtype)
                if on_bytes:
                    on_bytes(e.nbytes)
                weight_map[e.key] = name
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map}
        (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


@contextmanager
def atomic_folder(out: Path, force: bool = False) -> Iterator[Path]:
    """Yield a staging folder next to `out`; move it into place only if the block finishes without error."""
    out = Path(out)
    if out.exists() and not force:
        raise OutputExistsError(f"{out}: output folder already exists.",
                                hint="Pass --force to replace it, or choose another --out.")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes it private; the finished folder is an ordinary one
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "old")
        os.replace(staging, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staging, out)
