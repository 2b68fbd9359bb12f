"""The SVDQuant file to write for a model, as data (no torch): its quantized layers, 16-bit tensors and header.

The same table the reader uses (`mappings/svdquant.toml`) read the other way: each entry says which diffusers
tensors (or which rows / columns of one) make a stored layer. Layers are named in the family's first spelling
(FLUX.1: deepcompressor's names, as every published FLUX.1 file; FLUX.2: the runtime's module names, the form
tonera's strict loader takes), parts in `part_spelling`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from porting.errors import InputError, InternalError
from porting.tensors.quant.svdq.comfy import comfy_config
from porting.tensors.quant.svdq.reader import BLOCKS, TILE, table

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Slice:
    """Rows and columns of one diffusers tensor (None: all)."""

    key: str
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None


@dataclass(frozen=True)
class LayerPlan:
    name: str  # stored prefix, without the trailing '.'
    kind: str  # "w4a4" | "awq"
    n: int
    k: int
    weight: tuple[Slice, ...]  # stacked by rows
    bias: tuple[Slice | int, ...]  # stacked by rows; an int is that many zeros (empty: the family has no biases)
    pieces: tuple[int, ...]  # row counts of the fused tensors (one per-tensor nvfp4 scale each)
    gelu_shift: bool = False
    awq_splits: int = 0

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys([s.key for s in self.weight] + [s.key for s in self.bias
                                                                     if isinstance(s, Slice)]))


@dataclass
class FileLayout:
    family: str
    layers: list[LayerPlan]
    plain: list[tuple[str, str, Shape]]  # (stored key, diffusers key, shape), written in bf16
    part_names: dict[str, str]  # role -> stored spelling

    def entries(self, precision: str, rank: int) -> list[tuple[str, Shape, str]]:
        """(stored key, shape, safetensors dtype) of every tensor, in the order they are written."""
        out: list[tuple[str, Shape, str]] = []
        out += [(key, shape, "BF16") for key, _, shape in self.plain]
        for layer in self.layers:
            out += layer_entries(layer, precision, rank, self.part_names, bool(layer.bias))
        return out


def padded(rank: int) -> int:
    return -(-rank // 16) * 16


def layer_entries(layer: LayerPlan, precision: str, rank: int, names: Mapping[str, str], bias: bool
                  ) -> list[tuple[str, Shape, str]]:
    """The tensors deepcompressor's per-layer converter writes for one layer, in its order."""
    p, n, k = layer.name + ".", layer.n, layer.k
    if layer.kind == "awq":
        return [(p + names["qweight"], (n // 4, k // 2), "I32"), (p + names["wscales"], (k // 64, n), "BF16"),
                (p + names["wzeros"], (k // 64, n), "BF16"), (p + names["bias"], (n,), "BF16")]
    out = [(p + names["qweight"], (n, k // 2), "I8")]
    if precision == "int4":
        out.append((p + names["wscales"], (k // 64, n), "BF16"))
    else:
        out.append((p + names["wcscales"], (n,), "BF16") if len(layer.pieces) > 1
                   else (p + names["wtscale"], (1,), "BF16"))
        out.append((p + names["wscales"], (k // 16, n), "F8_E4M3"))
    if bias:
        out.append((p + names["bias"], (n,), "BF16"))
    r = padded(rank)
    out += [(p + names["smooth_orig"], (k,), "BF16"), (p + names["smooth"], (k,), "BF16"),
            (p + names["lora_down"], (k, r), "BF16"), (p + names["lora_up"], (n, r), "BF16")]
    return out


_BLOCK_KEY = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def plan_file(family: str, config: Mapping[str, Any], shapes: Mapping[str, Shape], where: str) -> FileLayout:
    """Which stored layer each diffusers tensor of `shapes` goes into; `where` names the source in errors."""
    fam = table()[family]
    width = config["num_attention_heads"] * config["attention_head_dim"]
    counts = {"transformer_blocks": config["num_layers"], "single_transformer_blocks": config["num_single_layers"]}
    spelling = fam["part_spelling"]
    names = {role: spellings[min(spelling, len(spellings) - 1)] for role, spellings in table()["parts"].items()}
    layers: list[LayerPlan] = []
    used: set[str] = set()
    for blocks in BLOCKS:
        for i in range(counts[blocks]):
            base = f"{blocks}.{i}."
            for entry in fam.get(blocks, []):
                new = _entry_layers(base, entry, fam["biases"], shapes, width, where)
                layers += new
                for layer in new:
                    used.update(layer.sources)
    inverse = {v: k for k, v in fam.get("plain", {}).items()} if fam["spellings"][0] == "deepcompressor" else {}
    plain: list[tuple[str, str, Shape]] = []
    for key in shapes:
        if key in used:
            continue
        m = _BLOCK_KEY.match(key)
        if m and m.group(3) not in inverse and m.group(3) not in fam.get("plain", {}).values():
            raise InternalError(f"{where}: {key} is in a block but in no layer of the SVDQuant table "
                                f"(mappings/svdquant.toml, {family}).")
        stored = f"{m.group(1)}.{m.group(2)}.{inverse[m.group(3)]}" if m and m.group(3) in inverse else key
        plain.append((stored, key, tuple(shapes[key])))
    for layer in layers:
        if layer.n % TILE or layer.k % TILE:
            raise InputError(f"{where}: {layer.weight[0].key} makes the {layer.n} x {layer.k} layer "
                             f"{layer.name}; Nunchaku's packed tiles need both sizes to be multiples of {TILE}.",
                             hint="SVDQuant fits FLUX.1 and FLUX.2 [klein] at their published sizes; a model this "
                                  "narrow can be converted to bf16, fp8 or GGUF instead.")
    return FileLayout(family, layers, plain, names)


def _entry_layers(base: str, entry: Mapping[str, Any], biases: bool, shapes: Mapping[str, Shape], width: int,
                  where: str) -> list[LayerPlan]:
    join = entry.get("join", "one")
    stored = [base + names[0] for names in entry["from"]]
    shifts = set(entry.get("gelu_shift", []))
    awq = entry.get("awq_splits", 0)
    kind = "awq" if awq else "w4a4"

    def weight_key(name: str) -> str:
        key = f"{base}{name}.weight"
        if key not in shapes:
            raise InputError(f"{where}: has no {key}, which SVDQuant's {stored[0]} is made of.")
        return key

    def bias_of(name: str, rows: tuple[int, int] | None, n: int) -> tuple[Slice | int, ...]:
        if not biases:
            return ()
        key = f"{base}{name}.bias"
        return (Slice(key, rows),) if key in shapes else (n,)

    if join == "split_rows":
        keys = [weight_key(t) for t in entry["to"]]
        sizes = [shapes[k][0] for k in keys]
        n, k = sum(sizes), shapes[keys[0]][1]
        bias = tuple(b for t, m in zip(entry["to"], sizes) for b in bias_of(t, None, m))
        return [LayerPlan(stored[0], kind, n, k, tuple(Slice(key) for key in keys), bias, tuple(sizes))]
    key = weight_key(entry["to"])
    n, k = shapes[key]
    if join == "one":
        return [LayerPlan(stored[0], kind, n, k, (Slice(key),), bias_of(entry["to"], None, n), (n,),
                          gelu_shift=0 in shifts, awq_splits=awq)]
    total = n if join == "rows" else k
    spans, start = [], 0
    for m in entry["split"]:
        size = m * width if m else total - start
        spans.append((start, start + size))
        start += size
    out = []
    for i, (name, span) in enumerate(zip(stored, spans)):
        if join == "rows":
            out.append(LayerPlan(name, kind, span[1] - span[0], k, (Slice(key, span),),
                                 bias_of(entry["to"], span, span[1] - span[0]), (span[1] - span[0],),
                                 gelu_shift=i in shifts))
        else:  # columns: the target's bias goes on the last piece (deepcompressor's ConcatLinear), zeros elsewhere
            bias = bias_of(entry["to"], None, n) if i == len(stored) - 1 else ((n,) if biases else ())
            out.append(LayerPlan(name, kind, n, span[1] - span[0], (Slice(key, None, span),), bias, (n,),
                                 gelu_shift=i in shifts))
    return out


def file_name(precision: str, rank: int, source: Path) -> str:
    """Nunchaku's file naming: svdq-{int4|fp4}_r{rank}-{model}.safetensors, with the rank stored (padded to 16):
    the one the loaders read, and the one merge puts in the name when the branch grows."""
    stem = source.name[: -len(".safetensors")] if source.name.endswith(".safetensors") else source.name
    stem = re.sub(r"^svdq-(int4|fp4)_r\d+-", "", stem)  # requantizing an SVDQuant file: one prefix, not two
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "model"
    return f"svdq-{'int4' if precision == 'int4' else 'fp4'}_r{padded(rank)}-{stem}.safetensors"


def quantization_config(precision: str, rank: int) -> dict[str, Any]:
    """`quantization_config` as nunchaku's merge_safetensors writes it. `rank` is the stored (padded) rank: the
    loaders size every `proj_down` / `proj_up` [features, rank] from it (nunchaku `models/linear.py`, the FLUX.1 v2
    and FLUX.2 `from_pretrained`), and merge_safetensors takes it from the stored `lora_down`."""
    if precision == "int4":
        q = {"dtype": "int4", "scale_dtype": None, "group_size": 64}
        return {"method": "svdquant", "weight": q, "activation": dict(q), "rank": rank}
    return {"method": "svdquant",
            "weight": {"dtype": "fp4_e2m1_all", "scale_dtype": [None, "fp8_e4m3_nan"], "group_size": 16},
            "activation": {"dtype": "fp4_e2m1_all", "scale_dtype": "fp8_e4m3_nan", "group_size": 16}, "rank": rank}


def metadata(family: str, config: Mapping[str, Any], precision: str, rank: int,
             extra: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The header metadata: `config` (diffusers), `comfy_config` (ComfyUI-nunchaku's), `model_class`,
    `quantization_config` (with the stored, padded rank), and what flux-port did."""
    meta = {"config": json.dumps(dict(config)), "comfy_config": json.dumps(comfy_config(family, config)),
            "model_class": table()[family]["model_class"],
            "quantization_config": json.dumps(quantization_config(precision, padded(rank)))}
    for key, value in (extra or {}).items():
        meta[key] = json.dumps(value)
    return meta


__all__ = ["Slice", "LayerPlan", "FileLayout", "plan_file", "layer_entries", "padded", "file_name",
           "quantization_config", "metadata"]
