"""Nunchaku SVDQuant checkpoints (int4 or nvfp4 weights plus a 16-bit low-rank branch), read as plain weights.

Declared by `quantization_config` metadata with `"method": "svdquant"`, or by `qweight` next to `wscales` and a
low-rank or smoothing part. Everything here reads the header only (plus the raw bytes of biases FLUX.2 has no place
for, to check that they are zero): `port inspect` of such a file never imports torch. Which stored layers make which
diffusers tensors is data (`mappings/svdquant.toml`); the arithmetic is in `decode.py`.

Each weight comes out as the weight the kernel multiplies by, W = R·diag(1/s) + U·D (R the dequantized 4-bit
residual, s the smoothing factors, U·D the low-rank branch), under diffusers' names and shapes, so detection, the
plan and `--strict` run on it as on any diffusers file.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

import tomllib

from porting.errors import InputError, UnsupportedQuantizationError
from porting.tensors.dtypes import nbytes
from porting.tensors.quant.base import Layout
from porting.tensors.quant.svdq.header import GELU_SHIFT, Piece, SvdqFile, SvdqLayer, Target
from porting.tensors.reader import Checkpoint, Quantization, TensorInfo, read_bytes

NAME = "Nunchaku SVDQuant"
METADATA_KEY = "quantization_config"
TILE = 128  # every packed dimension is a multiple of this
BLOCKS = ("transformer_blocks", "single_transformer_blocks")


@lru_cache(maxsize=1)
def table() -> dict[str, Any]:
    with resources.files("mappings").joinpath("svdquant.toml").open("rb") as f:
        return tomllib.load(f)


def claims(ckpt: Checkpoint) -> bool:
    if lite_config(ckpt) is not None:  # diffusers' own layout (svdq/lite.py): the same parts under other names
        return False
    if _declared_method(ckpt) == "svdquant":
        return True
    endings = {k.rsplit(".", 1)[-1] for k in ckpt.tensors}
    return "qweight" in endings and "wscales" in endings


def lite_config(ckpt: Checkpoint) -> dict | None:
    """The `quantization_config` of a diffusers folder in diffusers' Nunchaku layout (`quant_method` "nunchaku_lite"
    in its config.json), or None."""
    qc = (ckpt.config or {}).get("quantization_config")
    return qc if isinstance(qc, dict) and qc.get("quant_method") == table()["lite"]["quant_method"] else None


def _declared_method(ckpt: Checkpoint) -> str | None:
    doc = _quant_config(ckpt)
    return doc.get("method") if doc else None


def _quant_config(ckpt: Checkpoint) -> dict | None:
    return _metadata_object(ckpt, METADATA_KEY)


def _metadata_object(ckpt: Checkpoint, key: str) -> dict | None:
    """A header metadata entry holding a JSON object (None when absent); anything else is refused by name."""
    raw = (ckpt.metadata or {}).get(key)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise InputError(f"{ckpt.path}: header metadata {key!r} is not JSON ({e}).") from e
    if not isinstance(doc, dict):
        raise InputError(f"{ckpt.path}: header metadata {key!r} must be a JSON object.")
    return doc


@lru_cache(maxsize=1)
def _roles_by_spelling() -> dict[str, tuple[str, ...]]:
    return {role: tuple(names) for role, names in table()["parts"].items()}


def _role_of(part: str) -> str | None:
    for role, names in _roles_by_spelling().items():
        if part in names:
            return role
    return None


def read(ckpt: Checkpoint) -> SvdqFile:
    """Parse and check an SVDQuant header: precision, group size, rank, family, every layer and its parts."""
    doc = _quant_config(ckpt) or {}
    layers = _stored_layers(ckpt)
    if not layers:
        raise InputError(f"{ckpt.path}: declared as SVDQuant but holds no `qweight` tensor.")
    for prefix in layers:
        if not _BLOCK_LAYER.match(prefix):
            raise UnsupportedQuantizationError(
                f"{ckpt.path}: packed 4-bit layer {prefix[:-1]!r} (qweight, wscales) is not in a Nunchaku SVDQuant "
                "layout flux-port reads: SVDQuant files quantize the diffusers-named transformer blocks only. "
                "Nothing was written.", hint="Use the Nunchaku release as published, or a bf16, fp8 or GGUF release.")
    precision, group = _precision(ckpt, doc, layers)
    family = _family(ckpt)
    fam = table()[family]
    info = SvdqFile(family, precision, group, 0, config=_config(ckpt))
    _map_blocks(ckpt, fam, layers, info)
    info.rank = _rank(ckpt, doc, info)
    for stored, layer in info.layers.items():
        _check_layer(ckpt, layer, group)
    _drop_biases(ckpt, fam, info)
    info.plain_linears = sum(1 for k, t in ckpt.tensors.items()
                             if k not in info.consumed and k.endswith(".weight") and len(t.shape) == 2)
    info.written_by = _metadata_object(ckpt, "flux_port")
    info.merged = _metadata_list(ckpt, "flux_port_merged") + _metadata_list(ckpt, "merged_adapters")
    return info


def _metadata_list(ckpt: Checkpoint, key: str) -> list:
    """flux-port's record of merged adapters (a JSON list of objects) in the header metadata; [] when absent."""
    raw = (ckpt.metadata or {}).get(key)
    if raw is None:
        return []
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise InputError(f"{ckpt.path}: header metadata {key!r} is not JSON ({e}).") from e
    if not isinstance(doc, list) or not all(isinstance(d, dict) for d in doc):
        raise InputError(f"{ckpt.path}: header metadata {key!r} must be a JSON list of objects.")
    return doc


def _precision(ckpt: Checkpoint, doc: Mapping[str, Any], layers: Mapping[str, dict[str, TensorInfo]]
               ) -> tuple[str, int]:
    precisions = table()["precisions"]
    weight = doc.get("weight") if isinstance(doc.get("weight"), dict) else None
    if weight is not None:
        dtype = weight.get("dtype")
        precision = next((p for p, spec in precisions.items() if dtype in spec["dtypes"]), None)
        if precision is None:
            raise UnsupportedQuantizationError(
                f"{ckpt.path}: header metadata {METADATA_KEY!r}: weight dtype {dtype!r} is not an SVDQuant precision "
                f"flux-port knows ({', '.join(s for p in precisions.values() for s in p['dtypes'])}).",
                hint="Nunchaku writes int4 or fp4_e2m1_all; a file with another precision needs its producer's own "
                     "reader. Nothing was written.")
        group = weight.get("group_size", precisions[precision]["group_size"])
        if group != precisions[precision]["group_size"]:
            raise InputError(
                f"{ckpt.path}: header metadata {METADATA_KEY!r}: weight group_size {group!r} is not allowed for "
                f"{precision} (the kernel takes {precisions[precision]['group_size']}).",
                hint="The metadata and the packed scales cannot both be right; flux-port will not guess.")
        return precision, group
    # no metadata: the scales' dtype says which (fp8 micro-scales are nvfp4's)
    for parts in layers.values():
        scales = parts.get("wscales")
        if scales is not None and "qweight" in parts and parts["qweight"].dtype == "I8":
            precision = "nvfp4" if scales.dtype.startswith("F8") else "int4"
            return precision, precisions[precision]["group_size"]
    raise InputError(f"{ckpt.path}: no SVDQuant layer with packed int8 `qweight` and `wscales`; cannot tell the "
                     "precision.")


def _family(ckpt: Checkpoint) -> str:
    cfg = _config(ckpt) or {}
    meta_class = (ckpt.metadata or {}).get("model_class")
    names = {cfg.get("_class_name"), meta_class}
    keys = set(ckpt.tensors)
    for family in ("flux2", "flux1"):
        fam = table()[family]
        if names & set(fam["class_names"]) or any(m in keys for m in fam["markers"]):
            return family
    raise InputError(f"{ckpt.path}: an SVDQuant file of a model flux-port does not know (model_class "
                     f"{meta_class!r}, config class {cfg.get('_class_name')!r}); it reads FLUX.1 and FLUX.2 [klein].")


def _config(ckpt: Checkpoint) -> dict | None:
    return ckpt.config or _metadata_object(ckpt, "config")


_BLOCK_KEY = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
_BLOCK_LAYER = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)\.$")  # a layer prefix


def _stored_layers(ckpt: Checkpoint) -> dict[str, dict[str, TensorInfo]]:
    """Stored prefix -> role -> tensor, for every prefix with a `qweight`."""
    prefixes = {k[: -len("qweight")] for k in ckpt.tensors if k.endswith(".qweight")}
    out: dict[str, dict[str, TensorInfo]] = {p: {} for p in prefixes}
    for key, info in ckpt.tensors.items():
        prefix, _, part = key.rpartition(".")
        role = _role_of(part)
        if role is not None and prefix + "." in out:
            if role in out[prefix + "."]:
                first = out[prefix + "."][role].name
                raise InputError(f"{ckpt.path}: layer {prefix!r} has its {role} twice ({first!r} and {key!r}).")
            out[prefix + "."][role] = info
    return out


def _map_blocks(ckpt: Checkpoint, fam: Mapping[str, Any], stored: Mapping[str, dict[str, TensorInfo]],
                info: SvdqFile) -> None:
    """Build the targets of every block from the table; collect 16-bit in-block renames; refuse leftovers."""
    found_blocks: dict[tuple[str, int], set[str]] = {}
    for prefix in stored:
        m = _BLOCK_LAYER.match(prefix)
        found_blocks.setdefault((m.group(1), int(m.group(2))), set()).add(m.group(3))
    spellings: set[int] = set()
    for (blocks, index), local_layers in sorted(found_blocks.items()):
        base = f"{blocks}.{index}."
        used: set[str] = set()
        for entry in fam.get(blocks, []):
            pieces_layers = []
            for names in entry["from"]:
                hit = [(i, n) for i, n in enumerate(names) if n in local_layers]
                if not hit:
                    break
                spellings.add(hit[0][0])
                pieces_layers.append(hit[0][1])
            else:
                shifts = set(entry.get("gelu_shift", []))
                layers = [_layer(ckpt, base + name + ".", stored[base + name + "."], info.precision,
                                 shift=i in shifts and info.precision == "int4",
                                 awq=entry.get("awq_splits", 0)) for i, name in enumerate(pieces_layers)]
                used.update(pieces_layers)
                _add_targets(ckpt, base, entry, layers, info)
                continue
            if pieces_layers:
                missing = [names for names in entry["from"] if not set(names) & local_layers]
                raise InputError(f"{ckpt.path}: block {base[:-1]!r} has {', '.join(pieces_layers)} but not "
                                 f"{' / '.join(missing[0])}, which together make {entry['to']!r}.",
                                 hint="The file is incomplete or not in a layout flux-port knows.")
        left = sorted(local_layers - used)
        if left:
            raise InputError(f"{ckpt.path}: quantized layer {base + left[0]!r} is not one flux-port knows in a "
                             f"{table()[info.family]['title']} {blocks[:-1].replace('_', ' ')}.",
                             hint="Known layers: see mappings/svdquant.toml. Nothing was written.")
    names = fam.get("spellings", [])
    info.spelling = names[min(spellings)] if spellings and min(spellings) < len(names) else ""
    plain = fam.get("plain", {})
    for key in ckpt.tensors:
        m = _BLOCK_KEY.match(key)
        if m and key not in info.consumed and m.group(3) in plain:
            info.renamed[key] = f"{m.group(1)}.{m.group(2)}.{plain[m.group(3)]}"


def _layer(ckpt: Checkpoint, prefix: str, parts: dict[str, TensorInfo], precision: str, shift: bool,
           awq: int) -> SvdqLayer:
    q = parts.get("qweight")
    if q is None:
        raise InputError(f"{ckpt.path}: layer {prefix[:-1]!r} has no {prefix}qweight.")
    if awq:
        if q.dtype != "I32" or len(q.shape) != 2:
            raise InputError(f"{ckpt.path}: {q.name!r} is {q.dtype} {list(q.shape)}; an AWQ W4A16 layer stores "
                             "int32 [out/4, in/2].")
        n, k = q.shape[0] * 4, q.shape[1] * 2
        kind = "awq"
    else:
        if q.dtype != "I8" or len(q.shape) != 2:
            raise InputError(f"{ckpt.path}: {q.name!r} is {q.dtype} {list(q.shape)}; an SVDQuant W4A4 layer stores "
                             "int8 [out, in/2].")
        n, k = q.shape[0], q.shape[1] * 2
        kind = "w4a4"
    return SvdqLayer(prefix, kind, dict(parts), n, k, "int4" if awq else precision, shift, awq)


def _add_targets(ckpt: Checkpoint, base: str, entry: Mapping[str, Any], layers: list[SvdqLayer],
                 info: SvdqFile) -> None:
    join = entry.get("join", "one")
    for layer in layers:
        info.layers[layer.prefix] = layer
        info.consumed.update(p.name for p in layer.parts.values())
    whole = tuple(Piece(layer, (0, layer.n)) for layer in layers)
    biases = table()[info.family]["biases"]
    if join == "split_rows":
        (layer,) = layers
        names = entry["to"]
        if layer.n % len(names):
            raise InputError(f"{ckpt.path}: {layer.prefix}qweight has {layer.n} rows, not {len(names)} equal parts "
                             f"for {', '.join(names)}.")
        size = layer.n // len(names)
        for i, name in enumerate(names):
            piece = (Piece(layer, (i * size, (i + 1) * size)),)
            info.targets[f"{base}{name}.weight"] = Target(f"{base}{name}.weight", "weight", "rows", piece)
            if biases:
                info.targets[f"{base}{name}.bias"] = Target(f"{base}{name}.bias", "bias", "rows", piece)
        return
    name = entry["to"]
    kind = "columns" if join == "columns" else "rows"
    if kind == "columns" and len({p.layer.n for p in whole}) != 1:
        raise InputError(f"{ckpt.path}: the layers that make {base}{name} have different output sizes "
                         f"({', '.join(f'{p.layer.prefix[:-1]}: {p.layer.n}' for p in whole)}).")
    if kind == "rows" and len({p.layer.k for p in whole}) != 1:
        raise InputError(f"{ckpt.path}: the layers that make {base}{name} have different input sizes "
                         f"({', '.join(f'{p.layer.prefix[:-1]}: {p.layer.k}' for p in whole)}).")
    info.targets[f"{base}{name}.weight"] = Target(f"{base}{name}.weight", "weight", kind, whole)
    if biases:
        info.targets[f"{base}{name}.bias"] = Target(f"{base}{name}.bias", "bias", kind, whole)


def _check_layer(ckpt: Checkpoint, layer: SvdqLayer, group: int) -> None:
    where = f"{ckpt.path}: {layer.prefix[:-1]!r}"
    need = ("wscales", "wzeros") if layer.kind == "awq" else ("wscales",)
    for role in need:
        if role not in layer.parts:
            raise InputError(f"{where} has a qweight but no {role} ({layer.prefix}{role}).",
                             hint="A layer missing one of its parts cannot be read; the file is incomplete.")
    if layer.n % TILE or layer.k % TILE:
        raise InputError(f"{where}: {layer.n} x {layer.k} is not a multiple of {TILE} in both dimensions, as "
                         "Nunchaku's packed tiles need.", hint="The file is damaged or not a Nunchaku layout.")
    scales = layer.parts["wscales"]
    if layer.kind == "awq":
        groups = layer.k // 64
        if len(scales.shape) != 2 or scales.shape[1] != layer.n or scales.shape[0] < groups:
            raise InputError(f"{where}: wscales {list(scales.shape)} do not fit AWQ group-64 scales for "
                             f"[{layer.n}, {layer.k}] ([>= {groups}, {layer.n}]).")
        return
    want = "F8_E4M3" if layer.precision == "nvfp4" else ("BF16", "F16")
    if scales.dtype not in want:
        expected = want if isinstance(want, str) else " or ".join(want)
        raise InputError(f"{where}: wscales are {scales.dtype}; {layer.precision} stores {expected} scales.",
                         hint="The metadata's precision and the stored scales disagree.")
    if scales.numel != layer.n * layer.k // group:
        raise InputError(f"{where}: wscales {list(scales.shape)} are not one scale per {group} inputs of "
                         f"[{layer.n}, {layer.k}] (group size {group} for {layer.precision}).")
    for role in ("bias", "smooth", "smooth_orig", "wcscales"):
        t = layer.parts.get(role)
        want_n = layer.k if role.startswith("smooth") else layer.n
        if t is not None and t.numel != want_n:
            raise InputError(f"{where}: {t.name!r} has {t.numel} values, the layer needs {want_n}.")
    down, up = layer.parts.get("lora_down"), layer.parts.get("lora_up")
    if (down is None) != (up is None):
        raise InputError(f"{where}: the low-rank branch has only one of its factors ({(down or up).name!r}).")
    if down is not None and (down.shape[0] < layer.k or up.shape[0] < layer.n or down.shape[1] != up.shape[1]
                             or down.shape[1] % 16):
        raise InputError(f"{where}: low-rank factors {list(down.shape)} / {list(up.shape)} do not fit "
                         f"[{layer.n}, {layer.k}] (down [in, rank], up [out, rank], rank a multiple of 16).")


def _rank(ckpt: Checkpoint, doc: Mapping[str, Any], info: SvdqFile) -> int:
    ranks = {layer.rank for layer in info.layers.values() if layer.kind == "w4a4"}
    declared = doc.get("rank")
    if declared is not None:
        if not isinstance(declared, int) or isinstance(declared, bool) or declared < 0:
            raise InputError(f"{ckpt.path}: header metadata {METADATA_KEY!r}: rank {declared!r} is not a count.")
        padded = -(-declared // 16) * 16
        for layer in info.layers.values():
            if layer.kind == "w4a4" and layer.rank != padded:
                raise InputError(f"{ckpt.path}: {layer.parts['lora_down'].name if layer.rank else layer.prefix!r} "
                                 f"has rank {layer.rank}; the header metadata {METADATA_KEY!r} says rank {declared}.",
                                 hint="The metadata and the low-rank factors cannot both be right.")
        return declared
    return max(ranks) if ranks else 0


def _drop_biases(ckpt: Checkpoint, fam: Mapping[str, Any], info: SvdqFile) -> None:
    """A family without linear biases (FLUX.2): stored zero biases are dropped, any other refused by name."""
    if fam["biases"]:
        return
    for layer in info.layers.values():
        bias = layer.parts.get("bias")
        if bias is None:
            continue
        if not _all_zero(bias):
            raise InputError(f"{ckpt.path}: {bias.name!r} is not all zeros, and {fam['title']} has no bias there "
                             "to carry it.", hint="Dropping it would change what the model computes; flux-port "
                                                  "will not. Nothing was written.")
        info.dropped.append(bias.name)


def _all_zero(info: TensorInfo) -> bool:
    raw = read_bytes(info)
    if info.dtype in ("BF16", "F16"):  # every value +0 or -0: only the sign bits may be set
        return int.from_bytes(raw, "little") & int.from_bytes(b"\xff\x7f" * (len(raw) // 2), "little") == 0
    return not any(raw)


def view(ckpt: Checkpoint) -> Checkpoint:
    """The checkpoint as diffusers-named plain weights, computed from the packed layers on demand."""
    return view_of(ckpt, read(ckpt), NAME)


def view_of(ckpt: Checkpoint, info: SvdqFile, layout: str) -> Checkpoint:
    """The checkpoint seen through `info` (what a header of `layout` says): computed weights, plain rest."""
    tensors: dict[str, TensorInfo] = {}
    targets_by_anchor: dict[str, list[Target]] = {}
    for target in info.targets.values():
        anchor = target.pieces[0].layer.parts["qweight"].name
        targets_by_anchor.setdefault(anchor, []).append(target)
    for key, stored in ckpt.tensors.items():
        for target in targets_by_anchor.get(key, []):
            shape = target.shape
            tensors[target.key] = TensorInfo(target.key, "F32", shape, stored.file, stored.start,
                                             nbytes(shape, "F32"), computed=True)
        if key in info.consumed:
            continue
        name = info.renamed.get(key, key)
        tensors[name] = stored if name == key else TensorInfo(name, stored.dtype, stored.shape, stored.file,
                                                               stored.start, stored.nbytes)
    quant = Quantization(f"{layout} {info.precision}, rank {info.rank}, group {info.group_size}", info.counts(),
                         folded=sorted(info.consumed - set(info.dropped)), dropped=sorted(info.dropped),
                         dropped_why="zero biases of layers that have no bias in the model", notes=_notes(info),
                         details=describe(info))
    config = ckpt.config if ckpt.config is not None else info.config
    return Checkpoint(ckpt.path, tensors, ckpt.files, config, ckpt.metadata, stored=ckpt.tensors,
                      quantization=quant, decoder=LazyDecoder(info), container=ckpt.container)


def svdq_info(ckpt: Checkpoint) -> SvdqFile | None:
    """The SVDQuant header facts of an opened checkpoint (None: not an SVDQuant file); headers only, no torch."""
    decoder = ckpt.decoder
    return decoder.info if isinstance(decoder, LazyDecoder) else None


class LazyDecoder:
    """The SVDQuant decoder, imported (with torch) on the first tensor computed: opening a file stays torch-free."""

    def __init__(self, info: SvdqFile) -> None:
        self.info = info
        self._decoder: Any = None

    def dequantize(self, key: str, rows: tuple[int, int] | None = None, dtype: Any = None) -> Any:
        if self._decoder is None:
            from porting.tensors.quant.svdq.decode import SvdqDecoder

            self._decoder = SvdqDecoder(self.info)
        return self._decoder.dequantize(key, rows, dtype)


def _notes(info: SvdqFile) -> list[str]:
    notes = [f"dequantized from SVDQuant {info.precision}, rank {info.rank}: each weight is the one the kernel "
             "multiplies by, R/s + U·D"]
    fused = [p for p, layer in info.layers.items() if layer.kind == "w4a4" and layer.smoothing_fused]
    if fused:
        notes.append(f"{len(fused)} layer(s) have their smoothing folded into the previous layer (e.g. "
                     f"{fused[0][:-1]}): the model computes the same, but those weights differ per tensor from the "
                     "original bf16 ones by s")
    shifted = [p for p, layer in info.layers.items() if layer.gelu_shift]
    if shifted:
        notes.append(f"{len(shifted)} int4 GELU down-projection(s) carry the kernel's shift correction in their "
                     f"bias (+{GELU_SHIFT} x row sums of R/s)")
    return notes


def describe(info: SvdqFile) -> dict[str, Any]:
    """The header's facts for `port inspect` and the manifest."""
    return {"precision": info.precision, "rank": info.rank, "group_size": info.group_size, "family": info.family,
            "spelling": info.spelling, "layout": info.layout, "layers": info.counts(), "w4a4_layers": sum(
                1 for layer in info.layers.values() if layer.kind == "w4a4"),
            "w4a16_layers": sum(1 for layer in info.layers.values() if layer.kind == "awq"),
            "smoothing_fused_layers": sum(1 for layer in info.layers.values() if layer.smoothing_fused),
            "plain_16bit_linears": info.plain_linears,
            **({"written_by": info.written_by} if info.written_by else {}),
            **({"merged_adapters": info.merged} if info.merged else {})}


# Sidecars: the packed parts' names as stored; not deepcompressor's `smooth` / `lora_down` / `lora_up` nor `bias`,
# which plain files and adapters use too (a file in that spelling has `qweight` and `wscales`, its markers, anyway).
# `quantization_config` metadata alone does not mark it: SVDQuant is packed tensors first.
LAYOUT = Layout(NAME, sidecars=("qweight", "wscales", "wzeros", "wtscale", "wcscales", "smooth_factor", "smooth_orig",
                                "smooth_factor_orig", "proj_down", "proj_up"),
                markers=("qweight", "wscales"), recognise=claims, view=view)

__all__ = ["NAME", "LAYOUT", "claims", "read", "view", "view_of", "lite_config",
           "describe", "svdq_info", "SvdqFile", "SvdqLayer", "Target",
           "Piece", "GELU_SHIFT"]
