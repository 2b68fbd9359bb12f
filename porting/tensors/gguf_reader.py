"""GGUF files (city96 ComfyUI-GGUF style: BFL names, `general.architecture = "flux"` for FLUX.1 and FLUX.2).

Read with the `gguf` package: `GGUFReader` for the header, `gguf.quants.dequantize` for quantized tensors, a row
range at a time through plain reads (no memory map of the data, so resident memory stays at one block). GGML
stores shapes fastest-dimension first; torch shapes are the reverse. F32 / F16 / BF16 tensors are stored plain in
row-major order, so they are byte ranges the writer can copy; every other type is computed (float32).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from porting.errors import CheckFailed, InputError, UnsupportedQuantizationError

from .dtypes import nbytes
from .reader import Checkpoint, Quantization, TensorInfo

if TYPE_CHECKING:  # the header is read with gguf and numpy; torch only when a tensor is dequantized
    import torch

PLAIN = {"F32": "F32", "F16": "F16", "BF16": "BF16"}  # GGML type name -> safetensors tag


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as e:  # an optional dependency
        raise InputError("reading GGUF files needs the gguf package.",
                         hint="pip install 'flux-port[quant]'") from e
    return gguf


class GGUFDecoder:
    def __init__(self, path: Path, entries: dict[str, tuple[Any, int, int, tuple[int, ...]]]) -> None:
        from .files import reader_for

        self.path = path
        self.entries = entries  # key -> (GGML type, data offset, stored bytes, torch shape)
        self.reader = reader_for(path)  # one descriptor for every row block

    def dequantize(self, key: str, rows: tuple[int, int] | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        import torch

        dtype = torch.float32 if dtype is None else dtype
        gguf = _gguf()
        qtype, offset, stored, shape = self.entries[key]
        n = shape[0] if shape else 1
        a, b = rows or (0, n)
        if len(shape) < 2:  # a vector is one row of blocks: read it whole, then take the elements asked for
            out = self._rows(gguf, key, qtype, offset, stored, 1, (0, 1), dtype).reshape(-1)
            return out[a:b].clone() if (a, b) != (0, n) else out.reshape(shape)
        return self._rows(gguf, key, qtype, offset, stored // n, b - a, (a, b), dtype).reshape(b - a, *shape[1:])

    def _rows(self, gguf: Any, key: str, qtype: Any, offset: int, row_bytes: int, count: int,
              rows: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        import numpy as np
        import torch

        raw = np.empty((count, row_bytes), dtype=np.uint8)  # uninitialised: read over at once
        self.reader.read_into(memoryview(raw).cast("B"), offset + rows[0] * row_bytes, f"tensor {key!r}")
        if qtype.name == "Q8_0":
            return q8_0(raw, dtype)
        values = gguf.quants.dequantize(raw, qtype)
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        return out if dtype == torch.float32 else out.to(dtype)


Q8_0_PIECE = 8192  # blocks per pass (256K values): the float32 intermediate (1 MiB) stays in the CPU's cache


def q8_0(raw, dtype: torch.dtype) -> torch.Tensor:
    """Q8_0 blocks (fp16 scale d, 32 int8 codes) -> d * code in float32 (exact), rounded once to `dtype`.

    The same arithmetic as `gguf.quants.dequantize` (tests hold it bit for bit) with fewer passes over memory: the
    codes are scaled into a small float32 buffer that torch rounds into the output, a cache-sized piece at a time;
    about 5x faster than the package, which matters because Q8_0 is the common GGUF type for klein.
    """
    import numpy as np
    import torch

    blocks = raw.reshape(-1, 34)
    n = blocks.shape[0]
    scales = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    codes = blocks[:, 2:].view(np.int8)
    if dtype == torch.float32:
        values = np.empty((n, 32), np.float32)
        np.multiply(codes, scales, out=values)
        return torch.from_numpy(values).reshape(raw.shape[0], -1)
    out = torch.empty((n, 32), dtype=dtype)
    piece = np.empty((min(Q8_0_PIECE, n), 32), np.float32)
    piece_t = torch.from_numpy(piece)
    for a in range(0, n, Q8_0_PIECE):
        m = min(Q8_0_PIECE, n - a)
        np.multiply(codes[a:a + m], scales[a:a + m], out=piece[:m])
        out[a:a + m].copy_(piece_t[:m])
    return out.reshape(raw.shape[0], -1)


def check_layout(path: Path, gguf: Any, start: int, fields: list[Any], size: int, alignment: int) -> None:
    """Every tensor's declared type and shape must account for its bytes, and no two tensors may share bytes.

    Run on the tensor infos before the gguf package maps them (it trusts offsets and would hand out overlapping
    views). Like the safetensors reader: each tensor's bytes are its own; between one tensor's end and the next
    one's start (and after the last) lies at most the alignment padding, so a declared type too small for the
    bytes it was given is found too. A tensor running past the end of the file is a truncated file (exit 2).
    """
    spans = []
    for field in fields:
        _, name_data, _, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", "replace")
        try:
            qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise CheckFailed(f"{path}: tensor {name!r} declares GGML type {int(raw_type[0])}, which does not exist; "
                            "its bytes cannot be read as any type. Nothing was written.",
                            hint="The file is damaged or not a GGUF model; download it again.") from None
        shape = [int(d) for d in dims]
        if shape and shape[0] % block:
            raise CheckFailed(f"{path}: tensor {name!r} is declared {qtype.name} {list(reversed(shape))}, but its rows "
                            f"of {shape[0]} values do not split into {qtype.name} blocks of {block}; the declared "
                            "type does not fit the tensor. Nothing was written.",
                            hint="The file is damaged or its header lies; download it again.")
        n = 1
        for d in shape:
            n *= d
        begin = start + int(offset[0])
        spans.append((begin, begin + n * type_size // block, name, qtype.name))
    spans.sort()
    for (b0, e0, n0, t0), (b1, _, n1, _) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckFailed(f"{path}: header lies about offsets: tensor {n1!r} starts at byte {b1}, inside tensor "
                            f"{n0!r} (bytes {b0}..{e0 - 1}); overlapping tensors would read the same bytes as two "
                            "weights. Nothing was written.", hint="The file is damaged; download it again.")
        if b1 - e0 >= alignment:
            raise CheckFailed(f"{path}: tensor {n0!r} is declared {t0} and holds {e0 - b0} bytes, but {b1 - b0} bytes "
                            f"lie before the next tensor {n1!r} (alignment {alignment}); its declared type or shape "
                            "does not fit its bytes. Nothing was written.",
                            hint="The file is damaged or its header lies; download it again.")
    if spans:
        b0, e0, n0, t0 = spans[-1]
        if e0 > size:
            raise InputError(f"{path}: file is truncated: tensor {n0!r} ends at byte {e0}, the file has {size}.",
                             hint="Download it again.")
        if size - e0 >= alignment:
            raise CheckFailed(f"{path}: tensor {n0!r} is declared {t0} and holds {e0 - b0} bytes, but {size - e0} more "
                            f"bytes follow it to the end of the file (alignment {alignment}); its declared type or "
                            "shape does not fit its bytes. Nothing was written.",
                            hint="The file is damaged or its header lies; download it again.")


def _reader(gguf: Any, path: Path) -> Any:
    """`gguf.GGUFReader` with `check_layout` run on the tensor infos before it builds its tensor views."""

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            check_layout(path, gguf, start_offs, fields, len(self.data), int(self.alignment))
            super()._build_tensors(start_offs, fields)

    return Reader(path)


def open_gguf(path: Path) -> Checkpoint:
    gguf = _gguf()
    try:
        reader = _reader(gguf, path)
    except (InputError, CheckFailed):
        raise
    except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError, MemoryError) as e:
        # gguf's reader walks the header with numpy views: a file cut inside its header or key-value section ends
        # in an empty view (IndexError), an unknown value type (KeyError / ValueError) or a length past the end
        raise InputError(f"{path}: not a readable GGUF file: truncated or damaged in its header or key-value "
                         f"section ({type(e).__name__}: {e}).", hint="Check that the download finished.") from e
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    tensors: dict[str, TensorInfo] = {}
    entries: dict[str, tuple[Any, int, int, tuple[int, ...]]] = {}
    counts: dict[str, int] = {}
    checked: set[Any] = set()
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        name = t.tensor_type.name
        offset, stored = int(t.data_offset), int(t.n_bytes)
        if name in PLAIN:
            tag = PLAIN[name]
            if nbytes(shape, tag) != stored:
                raise InputError(f"{path}: tensor {t.name!r} {name} {list(shape)} should hold {nbytes(shape, tag)} "
                                 f"bytes, the header gives {stored}.")
            tensors[t.name] = TensorInfo(t.name, tag, shape, path, offset, stored)
            continue
        if t.tensor_type not in checked:
            _check_supported(gguf, t, path)
            checked.add(t.tensor_type)
        tensors[t.name] = TensorInfo(t.name, "F32", shape, path, offset, nbytes(shape, "F32"), computed=True)
        entries[t.name] = (t.tensor_type, offset, stored, shape)
        counts[name] = counts.get(name, 0) + 1
    end = max((e[1] + e[2] for e in entries.values()), default=0)
    if end > path.stat().st_size:
        raise InputError(f"{path}: file is truncated (tensor data ends at byte {end}).", hint="Download it again.")
    notes = [f"general.architecture = {arch!r}" if arch else "no general.architecture (stable-diffusion.cpp style)"]
    quant = Quantization("GGUF", counts, notes=notes)
    stored_view = {k: TensorInfo(k, v.dtype, v.shape, v.file, v.start, v.nbytes) for k, v in tensors.items()}
    for k, (qtype, offset, stored, shape) in entries.items():
        stored_view[k] = TensorInfo(k, qtype.name, (stored,), path, offset, stored)  # dtype: the GGML type name
    return Checkpoint(path, tensors, [path], metadata={"general.architecture": str(arch)} if arch else {},
                      stored=stored_view, quantization=quant if counts else None,
                      decoder=GGUFDecoder(path, entries), container="gguf")


def _check_supported(gguf: Any, t: Any, path: Path) -> None:
    """Dequantize one block of this type now, so an unsupported type is refused before anything is written."""
    import numpy as np

    _, size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    try:
        gguf.quants.dequantize(np.zeros((1, size), dtype=np.uint8), t.tensor_type)
    except NotImplementedError as e:
        raise UnsupportedQuantizationError(
            f"{path}: tensor {t.name!r} is GGML type {t.tensor_type.name}, which the gguf package cannot dequantize; "
            "nothing was written.", hint="Use a file in a common type (Q8_0, Q4_K, Q5_K, F16, BF16).") from e
