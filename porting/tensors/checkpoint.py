"""Lazy, header-first access to checkpoints: the safetensors reader and the dispatch to the other readers.

A checkpoint is a single `.safetensors` or `.gguf` file, a sharded folder with a `*.safetensors.index.json`, or a
diffusers model folder (`config.json` + `diffusion_pytorch_model*.safetensors`). Opening one reads headers only;
tensor bytes are read one tensor (or one row range) at a time. Which reader opens a file follows from its first
bytes (GGUF magic) and, for safetensors, from its header (quantization layouts, `porting.tensors.quant`).
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

from porting._files import parse_json, read_config, read_json
from porting.errors import InputError, UnsupportedFormatError
from porting.paths import check_plain_name

from . import dtypes
from .files import FileReader
from .identity import hash_checkpoint
from .reader import Checkpoint, TensorInfo
from .sidecars import may_be_quantized

__all__ = ["Checkpoint", "TensorInfo", "open_checkpoint", "read_header", "hash_checkpoint", "GGUF_MAGIC"]

GGUF_MAGIC = b"GGUF"


def __getattr__(name: str):
    """ST_TO_TORCH / TORCH_TO_ST are re-exported lazily: opening headers does not import torch."""
    if name in ("ST_TO_TORCH", "TORCH_TO_ST"):
        return getattr(dtypes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

PICKLE_SUFFIXES = {".ckpt", ".bin", ".pt", ".pth", ".pkl"}
MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a safetensors header without reading tensor data.

    Returns the tensors by stored key and the `__metadata__` dict.
    """
    path = Path(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UnsupportedFormatError(
            f"{path}: pickle checkpoints ({path.suffix}) can run arbitrary code when loaded; flux-port refuses them.",
            hint="Convert it to safetensors first in a sandbox you trust, e.g. with "
                 "`torch.load(path, weights_only=True)` followed by `safetensors.torch.save_file`.",
        )
    reader = FileReader(path)  # the one open of this file: the data is read through it later
    size = reader.size()
    head = reader.read(0, min(8, size))
    if len(head) < 8:
        raise InputError(f"{path}: not a safetensors file (only {size} bytes).",
                         hint="Check that the download finished.")
    (n,) = struct.unpack("<Q", head)
    if n == 0 or n > MAX_HEADER_BYTES or n > size - 8:
        raise InputError(
            f"{path}: not a safetensors file (header length field says {n} bytes, file has {size}).",
            hint="Is this a pickle or GGUF file renamed to .safetensors, or a truncated download?")
    raw = reader.read(8, n, "the header")
    header = parse_json(raw, str(path), what="safetensors header", kind=dict, object_pairs_hook=_unique_keys)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise InputError(f"{path}: safetensors header '__metadata__' must map names to strings (safetensors "
                         "metadata is string to string).", hint="The file is damaged or was not written by a "
                                                                 "safetensors library.")
    data_start = 8 + n
    data_size = size - data_start
    tensors: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for key, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise InputError(f"{path}: malformed header entry for tensor {key!r}.") from e
        if not all(_is_count(s) for s in shape) or not (_is_count(begin) and _is_count(end)):
            raise InputError(f"{path}: malformed header entry for tensor {key!r}: shape {list(shape)!r} and "
                             f"data_offsets {[begin, end]!r} must be non-negative integers.",
                             hint="The file is damaged or was not written by a safetensors library.")
        if dtype not in dtypes.TAGS:
            raise InputError(f"{path}: tensor {key!r} has dtype {dtype}, which flux-port cannot convert.",
                             hint="Supported: " + ", ".join(sorted(dtypes.TAGS)))
        expected = math.prod(shape) * dtypes.itemsize(dtype)
        if end - begin != expected or begin < 0:
            raise InputError(
                f"{path}: header lies about tensor {key!r}: shape {list(shape)} {dtype} needs {expected} bytes, "
                f"offsets [{begin}, {end}] give {end - begin}.")
        if end > data_size:
            raise InputError(
                f"{path}: file is truncated: tensor {key!r} ends at byte {end} of the data section, "
                f"which holds only {data_size} bytes.", hint="Download the file again.")
        spans.append((begin, end, key))
        tensors[key] = TensorInfo(key, dtype, shape, path, data_start + begin, end - begin, reader=reader)
    spans.sort()
    cursor = 0
    for begin, end, key in spans:
        if begin != cursor:
            raise InputError(f"{path}: header lies about offsets: tensor {key!r} starts at {begin}, expected {cursor} "
                             "(overlapping or gapped tensors).")
        cursor = end
    if cursor != data_size:
        raise InputError(f"{path}: data section holds {data_size} bytes but the header describes {cursor}.",
                         hint="The file is truncated or has trailing garbage; download it again.")
    # No `safe_open` second opinion here: it mmaps the whole file, which fails (ENOMEM) for a 64 GB FLUX.2-dev
    # file on a machine with less memory, and the checks above already cover what it would check.
    return tensors, metadata


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _index_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors.index.json"))


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a single file, a sharded folder or a diffusers model folder, headers only."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"{path}: no such file or folder.")
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _decode(_open_index(path))
        if _magic(path) == GGUF_MAGIC:
            from .gguf_reader import open_gguf

            return open_gguf(path)
        tensors, metadata = read_header(path)
        return _decode(Checkpoint(path, tensors, [path], metadata=metadata))
    if not path.is_dir():
        raise InputError(f"{path}: not a regular file or a folder (a pipe, socket or device?); flux-port reads "
                         "checkpoint files and folders only.")
    config = None
    if (path / "config.json").is_file():
        config = read_config(path / "config.json", "a diffusers model folder's config")
    indexes = _index_files(path)
    if len(indexes) > 1:
        raise InputError(f"{path}: several index files ({', '.join(p.name for p in indexes)}); pass one of them.")
    if indexes:
        ckpt = _open_index(indexes[0])
        ckpt.path, ckpt.config = path, config
        return _decode(ckpt)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in path.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES]
        if pickles:
            read_header(path / pickles[0])  # raises the pickle refusal
        raise InputError(f"{path}: no .safetensors file in this folder.")
    if {f.name for f in files} == set(SPLIT_PAIR):
        return _decode(_open_split_pair(path, files, config))
    if len(files) > 1:
        raise InputError(f"{path}: {len(files)} .safetensors files and no index.json; pass the file to use.",
                         hint="Files: " + ", ".join(p.name for p in files))
    tensors, metadata = read_header(files[0])
    return _decode(Checkpoint(path, tensors, files, config=config, metadata=metadata))


# Nunchaku's older FLUX.1 release: the quantized blocks and the 16-bit rest in two files, no index
SPLIT_PAIR = ("transformer_blocks.safetensors", "unquantized_layers.safetensors")


def _open_split_pair(folder: Path, files: list[Path], config: dict | None) -> Checkpoint:
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    for file in files:
        part, part_metadata = read_header(file)
        metadata.update(part_metadata)
        for key, info in part.items():
            if key in tensors:
                raise InputError(f"{folder}: tensor {key!r} is stored in both {tensors[key].file.name} and "
                                 f"{file.name}.")
            tensors[key] = info
    return Checkpoint(folder, tensors, files, config=config, metadata=metadata)


def _magic(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(4)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror}).") from e


def _decode(ckpt: Checkpoint) -> Checkpoint:
    """The same checkpoint seen through the quantization layout its header declares, if any."""
    if not may_be_quantized(ckpt.tensors, ckpt.metadata or {}):
        return ckpt  # plain weights: the quantized readers (and torch) are not needed to open it
    from .quant import decode

    return decode(ckpt)


def _open_index(index_path: Path) -> Checkpoint:
    doc = read_json(index_path, "a safetensors index", kind=None)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise InputError(f"{index_path}: not a valid safetensors index: it needs a 'weight_map' object of "
                         "tensor name -> shard file name.", hint="The index is damaged; download it again.")
    for shard_name in sorted(set(weight_map.values())):
        check_plain_name(shard_name, index_path, "shard file")  # next to the index, never elsewhere
    folder = index_path.parent
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    files = sorted({folder / f for f in weight_map.values()})
    for file in files:
        if not file.is_file():
            raise InputError(f"{index_path}: shard {file.name} listed in the index is missing.")
        shard, shard_metadata = read_header(file)
        metadata.update(shard_metadata)
        for key, info in shard.items():
            if key in tensors:
                raise InputError(f"{index_path}: tensor {key!r} is stored in two shards.")
            tensors[key] = info
    listed = set(weight_map)
    if listed != set(tensors):
        missing = sorted(listed - set(tensors))[:5]
        extra = sorted(set(tensors) - listed)[:5]
        raise InputError(f"{index_path}: index and shards disagree "
                         f"(in index only: {missing}; in shards only: {extra}).")
    return Checkpoint(index_path.parent, tensors, files, metadata=metadata)
