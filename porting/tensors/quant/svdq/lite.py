"""diffusers' own Nunchaku layout ("Nunchaku Lite", diffusers >= 0.42 `quantizers/nunchaku`), read as plain weights.

A diffusers transformer folder whose config.json carries `quantization_config` with `quant_method` "nunchaku_lite":
`svdq_w4a4` {precision, group_size, rank, targets} and `awq_w4a16` {precision, group_size, targets}. Each target is
an existing `nn.Linear` of the diffusers model, named as diffusers names it (unfused: `to_q`, `to_k`, `to_v`; klein's
single block `attn.to_qkv_mlp_proj` and `attn.to_out` whole), its parts stored under that name with the runtime's
part names (`qweight`, `wscales`, `smooth_factor`, `proj_down`, `proj_up`, `bias` iff the linear has one; nvfp4
`wcscales` and `wtscale` on every layer; AWQ `qweight`, `wscales`, `wzeros`). The packed tensors are Nunchaku's own
(the same kernels run them), so every layer is an `SvdqLayer` of one piece, decoded by `decode.py` like any other;
what differs from Nunchaku's file: no fused or split layers, no GELU-shift bias (diffusers runs every linear with
signed activations), and AWQ layers as plain linears (rows in order, no +1 on the adaLN scale slots).

Headers and config only: `port inspect` of such a folder never imports torch.
"""

from __future__ import annotations

from typing import Any, Mapping

from porting.errors import InputError, UnsupportedQuantizationError
from porting.tensors.quant.base import Layout
from porting.tensors.quant.svdq import reader as R
from porting.tensors.quant.svdq.header import Piece, SvdqFile, Target
from porting.tensors.reader import Checkpoint, TensorInfo

NAME = "Nunchaku Lite (diffusers)"
OPS = ("svdq_w4a4", "awq_w4a16")


def claims(ckpt: Checkpoint) -> bool:
    return R.lite_config(ckpt) is not None


def _op(ckpt: Checkpoint, qc: Mapping[str, Any], op: str) -> dict | None:
    raw = qc.get(op)
    if raw is None:
        return None
    targets = raw.get("targets") if isinstance(raw, dict) else None
    if not isinstance(targets, list) or not all(isinstance(t, str) and t for t in targets):
        raise InputError(f"{ckpt.path}: config.json quantization_config.{op} needs a 'targets' list of module names.",
                         hint="The folder's config.json is damaged or not diffusers' Nunchaku layout.")
    return raw


def _precision(ckpt: Checkpoint, raw: Mapping[str, Any], op: str) -> tuple[str, int]:
    precisions = R.table()["precisions"]
    precision = raw.get("precision")
    if precision not in precisions or (op == "awq_w4a16" and precision != "int4"):
        raise UnsupportedQuantizationError(
            f"{ckpt.path}: config.json quantization_config.{op}.precision {precision!r} is not one flux-port reads "
            f"({'int4' if op == 'awq_w4a16' else ', '.join(precisions)}). Nothing was written.",
            hint="diffusers' Nunchaku layout stores int4 or nvfp4; a file with another precision needs its producer's "
                 "own reader.")
    group = 64 if op == "awq_w4a16" else precisions[precision]["group_size"]
    if raw.get("group_size", group) != group:
        raise InputError(f"{ckpt.path}: config.json quantization_config.{op}.group_size {raw.get('group_size')!r} "
                         f"is not the {group} that {precision} {op} layers take.",
                         hint="The config and the packed scales cannot both be right; flux-port will not guess.")
    return precision, group


def _targets(ckpt: Checkpoint, qc: Mapping[str, Any]) -> dict[str, str]:
    """Target module name -> op, each named once."""
    out: dict[str, str] = {}
    for op in OPS:
        raw = _op(ckpt, qc, op)
        for target in (raw or {}).get("targets", []):
            if target in out:
                raise InputError(f"{ckpt.path}: config.json quantization_config names {target!r} twice "
                                 f"({out[target]} and {op}).")
            out[target] = op
    if not out:
        raise InputError(f"{ckpt.path}: config.json quantization_config (nunchaku_lite) has no svdq_w4a4 or "
                         "awq_w4a16 targets.", hint="diffusers refuses such a config too.")
    return out


def _stored_layers(ckpt: Checkpoint, targets: Mapping[str, str]) -> dict[str, dict[str, TensorInfo]]:
    """Target prefix -> role -> stored tensor; a packed part outside every target is refused by name."""
    lite = R.table()["lite"]
    names = {*lite["svdq_parts"], *lite["nvfp4_parts"], *lite["awq_parts"], "bias"}
    out: dict[str, dict[str, TensorInfo]] = {t + ".": {} for t in targets}
    for key, info in ckpt.tensors.items():
        prefix, _, part = key.rpartition(".")
        if prefix in targets and part in names:
            out[prefix + "."][R._role_of(part) or part] = info
        elif part in names and part != "bias":
            raise InputError(f"{ckpt.path}: {key!r} is a packed Nunchaku part of {prefix!r}, which config.json's "
                             "quantization_config does not list as a target.",
                             hint="The config and the weights disagree; flux-port will not guess the layer's op.")
    return out


def _check_parts(ckpt: Checkpoint, target: str, op: str, precision: str, parts: Mapping[str, TensorInfo],
                 biases: bool) -> None:
    lite = R.table()["lite"]
    want = list(lite["awq_parts"] if op == "awq_w4a16" else lite["svdq_parts"])
    if op == "svdq_w4a4" and precision == "nvfp4":
        want += lite["nvfp4_parts"]
    have = {info.name.rpartition(".")[2] for info in parts.values()}
    missing = [p for p in want if p not in have]
    if missing:
        raise InputError(f"{ckpt.path}: {op} target {target!r} has no {target}.{missing[0]} "
                         f"({len(missing)} part(s) missing: {', '.join(missing)}).",
                         hint="diffusers' loader refuses a layer with a part missing; the folder is incomplete.")
    if "bias" in have and not biases:
        raise InputError(f"{ckpt.path}: {target}.bias: {R.table()[_family(ckpt)]['title']} linears have no bias.",
                         hint="diffusers' loader would refuse the key too. Nothing was written.")


def _family(ckpt: Checkpoint) -> str:
    cls = (ckpt.config or {}).get("_class_name")
    for family in ("flux2", "flux1"):
        if cls in R.table()[family]["class_names"]:
            return family
    raise InputError(f"{ckpt.path}: diffusers' Nunchaku layout for a {cls!r} model; flux-port reads FLUX.1 and "
                     "FLUX.2 [klein].")


def read(ckpt: Checkpoint) -> SvdqFile:
    """Parse and check the folder's quantization config against its tensors: every target, every part."""
    qc = R.lite_config(ckpt)
    assert qc is not None
    family = _family(ckpt)
    fam = R.table()[family]
    targets = _targets(ckpt, qc)
    svdq = _op(ckpt, qc, "svdq_w4a4")
    precision, group = _precision(ckpt, svdq, "svdq_w4a4") if svdq else ("int4", 64)
    if _op(ckpt, qc, "awq_w4a16"):
        _precision(ckpt, qc["awq_w4a16"], "awq_w4a16")
    rank = svdq.get("rank", 32) if svdq else 0
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise InputError(f"{ckpt.path}: config.json quantization_config.svdq_w4a4.rank {rank!r} is not a count.")
    info = SvdqFile(family, precision, group, rank, config=dict(ckpt.config or {}), spelling="diffusers",
                    layout="diffusers")
    for prefix, parts in _stored_layers(ckpt, targets).items():
        target, op = prefix[:-1], targets[prefix[:-1]]
        _check_parts(ckpt, target, op, precision, parts, fam["biases"])
        awq = op == "awq_w4a16"
        layer = R._layer(ckpt, prefix, dict(parts), precision, shift=False, awq=1 if awq else 0)
        R._check_layer(ckpt, layer, 64 if awq else group)
        if not awq and layer.rank != rank:
            raise InputError(f"{ckpt.path}: {target}.proj_down {list(parts['lora_down'].shape)} has rank "
                             f"{layer.rank}; config.json says rank {rank}.",
                             hint="The config and the low-rank factors cannot both be right.")
        info.layers[prefix] = layer
        info.consumed.update(p.name for p in parts.values())
        piece = (Piece(layer, (0, layer.n)),)
        info.targets[f"{target}.weight"] = Target(f"{target}.weight", "weight", "rows", piece)
        if "bias" in parts:
            info.targets[f"{target}.bias"] = Target(f"{target}.bias", "bias", "rows", piece)
    info.written_by = R._metadata_object(ckpt, "flux_port")
    info.merged = R._metadata_list(ckpt, "flux_port_merged") + R._metadata_list(ckpt, "merged_adapters")
    info.plain_linears = sum(1 for k, t in ckpt.tensors.items()
                             if k not in info.consumed and k.endswith(".weight") and len(t.shape) == 2)
    return info


def view(ckpt: Checkpoint) -> Checkpoint:
    """The folder as diffusers-named plain weights, computed from the packed layers on demand."""
    out = R.view_of(ckpt, read(ckpt), NAME)
    # what is read is plain weights: a folder written from them must not declare the packed layout
    out.config = {k: v for k, v in (ckpt.config or {}).items() if k != "quantization_config"}
    return out


LAYOUT = Layout(NAME, sidecars=("qweight", "wscales", "wzeros", "wtscale", "wcscales", "smooth_factor", "proj_down",
                                "proj_up"), markers=("qweight", "wscales"), recognise=claims, view=view)

__all__ = ["NAME", "LAYOUT", "OPS", "claims", "read", "view"]
