"""Nunchaku's 4-bit text encoders (the FLUX.2 [klein] 9B-KV release's Qwen3, FLUX.1's T5-XXL): AWQ W4A16 in
deepcompressor's "TinyChat" layout.

Each 4-bit linear `X` stores `X.qweight` (int16 [n/4, k]: unsigned 4-bit codes, 4 output rows interleaved per 64
inputs), `X.scales` and `X.scaled_zeros` (16-bit [groups, n], groups rounded up by the writer and padded with zeros).
The kernel computes W = q * scales + scaled_zeros per (output row, input group): asymmetric, no +1 bias trick. The
group size is the metadata's `quantization_config.weight.group_size` (Qwen3, default 128) or 128 (T5's loader has it
fixed). The nibble order is the one FLUX.1's AWQ adaLN layers use (svdq/tiles.py: unpack_awq_codes).
Facts: shared/nunchaku-dialects.md section 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from porting.errors import InputError

from ..reader import Checkpoint, TensorInfo
from .base import Found, Layer, Layout, Parts, Scheme

if TYPE_CHECKING:
    import torch

NAME = "Nunchaku AWQ W4A16 (TinyChat, 4-bit text encoder)"
GROUP_SIZES = (32, 64, 128)  # what deepcompressor's TinyChat writer packs; the CUDA gemm_awq kernel needs 128
DEFAULT_GROUP = 128
HINT = "The file is damaged or not in the TinyChat AWQ layout its keys suggest; flux-port will not guess."


def padded_groups(k: int, group: int) -> int:
    """The writer's group count for `k` inputs: rounded up to whole int32 packs of 8, and for small groups to 2 or 4
    packs (deepcompressor `ceil_num_groups`)."""
    packs = -(-(k // group) // 8)
    factor = {32: 4, 64: 2}.get(group, 1)
    return -(-packs // factor) * factor * 8


def group_size(metadata: Mapping[str, str] | None, where: str) -> tuple[int, bool]:
    """(group size, whether the metadata stated it) as the loaders read it."""
    for key in ("quantization_config", "text_quantization_config"):
        raw = (metadata or {}).get(key)
        if raw is None:
            continue
        try:
            doc: Any = json.loads(raw)
        except ValueError:
            raise InputError(f"{where}: metadata {key!r} is not JSON.", hint=HINT) from None
        value = doc.get("weight", {}).get("group_size") if isinstance(doc, dict) and isinstance(
            doc.get("weight"), dict) else None
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value not in GROUP_SIZES:
                raise InputError(f"{where}: metadata {key!r} gives group_size {value!r}; the TinyChat layout packs "
                                 f"groups of {', '.join(map(str, GROUP_SIZES))} only.", hint=HINT)
            return value, True
    return DEFAULT_GROUP, False


@dataclass(frozen=True)
class TinyChat(Scheme):
    """W = q * scales + scaled_zeros, q unsigned 4-bit, one scale and zero per (input group, output row)."""

    name: str
    group: int

    required = ("scales", "scaled_zeros")

    def shape(self, parts: Mapping[str, TensorInfo]) -> tuple[int, ...]:
        quarter, k = parts["weight"].shape
        return (4 * quarter, k)

    def check(self, parts: Mapping[str, TensorInfo]) -> str | None:
        q, s, z = parts["weight"], parts["scales"], parts["scaled_zeros"]
        if q.dtype != "I16" or len(q.shape) != 2:
            return f"qweight must be int16 [n/4, k], is {q.dtype} {list(q.shape)}"
        n, k = self.shape(parts)
        if k % 64:
            return f"k = {k} inputs is not a multiple of 64 (the packing interleaves 4 rows per 64 inputs)"
        if k % self.group:
            return f"k = {k} inputs is not a multiple of the group size {self.group}"
        want = (padded_groups(k, self.group), n)
        for part in (s, z):
            if part.dtype not in ("BF16", "F16") or tuple(part.shape) != want:
                return (f"{part.name.rsplit('.', 1)[-1]} is {part.dtype} {list(part.shape)}; codes [{n}, {k}] in "
                        f"groups of {self.group} need 16-bit {list(want)}")
        return None

    def check_scale(self, role: str, t: torch.Tensor, info: TensorInfo) -> None:
        """Finite values (a zero zero-point or scale is a constant group, not damage)."""
        from porting.finite import check_tensor

        check_tensor(t, f"quantization {role} {info.name!r}", info.file, hint=HINT)

    def _groups(self, parts: Parts, role: str) -> torch.Tensor:
        """`role` ([groups, n]) with the writer's zero padding checked and cut: a non-zero pad is a file written some
        other way."""
        import torch

        t = parts.whole(role)
        used = self.shape(parts.layer.parts)[1] // self.group
        pad = t[used:].ne(0).any(dim=1)
        if bool(pad.any()):
            info = parts.info(role)
            row = used + int(torch.nonzero(pad)[0])
            raise InputError(f"{info.file}: {info.name!r} holds non-zero values in group row {row}, past the {used} "
                             f"groups of its {used * self.group} inputs (the writer pads those rows with zeros).",
                             hint=HINT)
        return t[:used]

    def dequantize_f32(self, parts: Parts, rows: tuple[int, int]) -> torch.Tensor:
        from .svdq.tiles import unpack_awq_codes

        a, b = rows
        first, last = a // 4, -(-b // 4)
        _, k = self.shape(parts.layer.parts)
        codes = unpack_awq_codes(parts.rows("weight", (first, last)), 4 * (last - first), k)
        codes = codes[a - 4 * first: b - 4 * first].float()
        s = self._groups(parts, "scales")[:, a:b].float().t().repeat_interleave(self.group, dim=1)
        z = self._groups(parts, "scaled_zeros")[:, a:b].float().t().repeat_interleave(self.group, dim=1)
        return codes.mul_(s).add_(z)


def claims(ckpt: Checkpoint) -> bool:
    endings = {k.rsplit(".", 1)[-1] for k in ckpt.tensors}
    return {"qweight", "scales", "scaled_zeros"} <= endings


def find(ckpt: Checkpoint) -> Found:
    where = str(ckpt.path)
    group, stated = group_size(ckpt.metadata, where)
    scheme = TinyChat(f"AWQ W4A16 int4 g{group}", group)
    found = Found(NAME)
    for key in sorted(k for k in ckpt.tensors if k.endswith(".qweight")):
        prefix = key[: -len("qweight")]
        parts = {"weight": ckpt.tensors[key]}
        for role in scheme.required:
            if prefix + role not in ckpt.tensors:
                raise InputError(f"{where}: {key!r} is 4-bit AWQ but {prefix + role!r} is missing.", hint=HINT)
            parts[role] = ckpt.tensors[prefix + role]
        if prefix + "weight" in ckpt.tensors:
            raise InputError(f"{where}: {prefix}weight is stored beside its 4-bit {key!r}: two weights for one "
                             "layer.", hint=HINT)
        why = scheme.check(parts)
        if why:
            source = "" if stated else f" (group {group}: the loaders' default, the metadata states none)"
            raise InputError(f"{where}: {key!r} ({scheme.name}): {why}{source}.", hint=HINT)
        found.layers[prefix + "weight"] = Layer(prefix + "weight", scheme, parts)
        found.consumed.update(p.name for p in parts.values())
    stray = sorted(k for k in ckpt.tensors if k.rsplit(".", 1)[-1] in ("scales", "scaled_zeros")
                   and k not in found.consumed)
    if stray:
        raise InputError(f"{where}: {stray[0]!r} has no 4-bit qweight beside it.", hint=HINT)
    found.notes.append(f"group size {group}" + ("" if stated else " (not stated in the metadata: the loaders' "
                                                                   "default)"))
    return found


LAYOUT = Layout(NAME, sidecars=("qweight", "scales", "scaled_zeros"), markers=("qweight", "scales", "scaled_zeros"),
                find=find)

__all__ = ["NAME", "LAYOUT", "GROUP_SIZES", "TinyChat", "claims", "find", "group_size", "padded_groups"]
