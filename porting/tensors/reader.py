"""The tensor-reader seam: what the engine sees of any checkpoint file, whatever its format.

A reader describes tensors (key, dtype, shape) from headers alone and hands each one out in one of two ways:
- a byte range of a file (`TensorInfo.byte_range`): the tensor is stored as-is, row-major, so the writer can copy it
  file to file without reading it into memory;
- a computed tensor (`TensorInfo.computed`): the reader's decoder produces it in float32, e.g. by dequantizing a
  quantized weight with its scales, optionally a row range at a time so memory stays flat.

`Checkpoint` is that view. Formats are modules that build one: `checkpoint.py` (safetensors), `quant/*` (quantized
safetensors layouts, detected from the header), `gguf_reader.py` (GGUF). The engine never asks which format it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Protocol

if TYPE_CHECKING:
    import torch

from porting.errors import InputError

from .dtypes import torch_dtype


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the engine sees it: known from the header alone."""

    name: str
    dtype: str  # safetensors tag; float32 ("F32") for computed tensors
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset of the tensor data in `file` (for computed tensors: of its main stored part)
    nbytes: int  # logical size in `dtype`
    computed: bool = False  # True: no byte range; the checkpoint's decoder computes it
    # the file opened once when its header was read (files.FileReader): every read of the data goes through it
    reader: Any = field(default=None, compare=False, repr=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def byte_range(self) -> tuple[Path, int, int] | None:
        """`(file, offset, length)` of the tensor's row-major bytes, or None when it has to be computed."""
        return None if self.computed else (self.file, self.start, self.nbytes)


class Decoder(Protocol):
    """Computes the tensors a reader marks `computed`."""

    def dequantize(self, key: str, rows: tuple[int, int] | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `key` (or rows [a, b) of dim 0): dequantized in float32, then rounded once to `dtype`."""
        ...


@dataclass
class Quantization:
    """What a quantized source holds and what reading it as plain weights does to it."""

    format: str  # the file's layout, e.g. "ComfyUI scaled fp8"
    layers: dict[str, int]  # per-tensor scheme -> how many tensors are dequantized with it
    folded: list[str] = field(default_factory=list)  # sidecar tensors consumed by dequantization
    dropped: list[str] = field(default_factory=list)  # sidecar tensors with no meaning for plain weights
    dropped_why: str = ""
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)  # layout-specific facts (precision, rank, ...)

    @property
    def label(self) -> str:
        schemes = ", ".join(f"{n} x {c}" for n, c in sorted(self.layers.items()))
        return f"{self.format} ({schemes})" if schemes else self.format

    @property
    def tensor_count(self) -> int:
        return sum(self.layers.values())

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "label": self.label, "layers": dict(sorted(self.layers.items())),
                "dequantized_tensors": self.tensor_count, "folded": len(self.folded), "dropped": self.dropped,
                "dropped_why": self.dropped_why, "notes": self.notes,
                **({"details": self.details} if self.details else {})}


@dataclass
class Checkpoint:
    """A set of tensors spread over one or more files, addressed by key: the reader the engine uses."""

    path: Path
    tensors: dict[str, TensorInfo]
    files: list[Path]
    config: dict | None = None  # config.json of a diffusers model folder
    metadata: dict[str, str] = field(default_factory=dict)
    stored: dict[str, TensorInfo] | None = None  # the tensors as stored on disk, when they differ (quantized)
    quantization: Quantization | None = None
    decoder: Decoder | None = None
    container: str = "safetensors"
    spelled_as: dict[str, str] = field(default_factory=dict)  # key -> the key as stored, where they differ

    def respelled(self, renames: Mapping[str, str]) -> Checkpoint:
        """The same checkpoint with the stored keys in `renames` addressed by another name: another tool's spelling
        of the same tensor (mapping tables' `[aliases]`). Order and bytes are kept; reads go to the stored key. This
        checkpoint is left as it is (`self` when there is nothing to rename)."""
        if not renames:
            return self
        tensors = {renames.get(k, k): replace(info, name=renames[k]) if k in renames else info
                   for k, info in self.tensors.items()}
        spelled_as = {**self.spelled_as, **{new: self.spelled_as.get(old, old) for old, new in renames.items()}}
        return replace(self, tensors=tensors, spelled_as=spelled_as)

    @property
    def stored_tensors(self) -> dict[str, TensorInfo]:
        return self.stored if self.stored is not None else self.tensors

    @property
    def total_bytes(self) -> int:
        """Bytes on disk (quantized storage for quantized files)."""
        return sum(t.nbytes for t in self.stored_tensors.values())

    @property
    def parameter_count(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    def dtypes(self) -> dict[str, int]:
        """Stored dtypes and how many tensors have each."""
        counts: dict[str, int] = {}
        for t in self.stored_tensors.values():
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
        return dict(sorted(counts.items()))

    def read(self, key: str, rows: tuple[int, int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, or rows [a, b) of dim 0: stored bytes as they are, computed tensors from the decoder (float32).

        With `dtype`, the result is cast to it (computed tensors: float32 values rounded once, decoders may take a
        faster path to the same values).
        """
        import torch

        info = self.tensors[key]
        if info.computed:
            if self.decoder is None:
                raise InputError(f"internal: {key!r} is computed but {self.path} has no decoder.")
            out = self.decoder.dequantize(self.spelled_as.get(key, key), rows, dtype or torch.float32)
            _check_dequantized(out, key, self.path, rows, out.dtype)
            return out
        t = read_stored(info, rows)
        return t if dtype is None else t.to(dtype)


def _check_dequantized(t: torch.Tensor, key: str, path: Path, rows: tuple[int, int] | None,
                       dtype: torch.dtype) -> None:
    """A dequantized block is checked as it is computed: NaN or Inf (a damaged code or scale, or a value beyond the
    output dtype once rounded to it) is refused by name, never written."""
    from porting.finite import check_tensor, dtype_name

    where = f"rows {rows[0]}..{rows[1] - 1} of " if rows is not None else ""
    rounded = "" if str(dtype) == "torch.float32" else f" and rounded to {dtype_name(dtype)}"
    check_tensor(t, f"{where}tensor {key!r} once dequantized{rounded}", path,
                 hint="A quantization code or block scale in the file is NaN or Inf, or the values do not fit the "
                      "output dtype (try --dtype bf16 or fp32); the file may be damaged.")


def _reader(info: TensorInfo) -> Any:
    from .files import reader_for

    return info.reader if info.reader is not None else reader_for(info.file)


def read_bytes(info: TensorInfo) -> bytes:
    """A stored tensor's raw bytes, without torch (small tensors a header-only reader needs, e.g. JSON markers)."""
    return _reader(info).read(info.start, info.nbytes, f"tensor {info.name!r}")


def read_stored(info: TensorInfo, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Read a stored tensor, or rows [a, b) of dim 0, with positioned reads on the file's one descriptor.

    Plain reads instead of mmap keep resident memory at one tensor: mapped pages of a 18 GB file would otherwise
    count towards the process RSS.
    """
    import torch

    start, nbytes, shape = info.start, info.nbytes, list(info.shape)
    if rows is not None:
        a, b = rows
        row_bytes = info.nbytes // info.shape[0] if info.shape[0] else 0
        start, nbytes, shape[0] = start + a * row_bytes, (b - a) * row_bytes, b - a
    buf = torch.empty(nbytes, dtype=torch.uint8)  # uninitialised: no time spent zeroing what is read over
    _reader(info).read_into(memoryview(buf.numpy()), start, f"tensor {info.name!r}")
    return buf.view(info.torch_dtype).reshape(shape)
