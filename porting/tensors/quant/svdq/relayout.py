"""SVDQuant layers moved between Nunchaku's file layout and diffusers' (Nunchaku Lite) without requantizing.

A layer is unpacked to its logical parts (`Logical`: 4-bit codes, group scales, nvfp4 row scales, smoothing s,
low-rank D (r, k) and U (n, r), AWQ zeros), cut or joined, and packed again:

- rows [a, b) (q, k, v of a fused qkv): codes, scales, row scales and U by rows; s and D shared. Exact.
- columns [a, b) (klein's single-block out_proj | mlp_fc2 of `to_out`): codes, group scales, s and D by columns; U
  and the row scales shared. Exact.
- joined by rows (pieces reading the same input: to_q/k/v, klein's qkv_proj + mlp_fc1): exact only when the pieces
  share one smoothing s; their branches are concatenated (D stacked, U block-diagonal), or shared when their D are
  equal. Otherwise `NotExact`, and the caller requantizes that layer, saying so.
- joined by columns (the pieces read consecutive inputs): s concatenated; the branches concatenated (U side by
  side, D block-diagonal) or U shared when equal; nvfp4 needs equal row scales, else `NotExact`.

Zero rank components (a zero column of U or row of D) are dropped, then every layer padded to the layout's one
rank. The bf16 weight each layer reads as is the same either way (`decode.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from porting.tensors.quant.svdq import tiles as P
from porting.tensors.quant.svdq.header import SvdqLayer
from porting.tensors.quant.svdq.quantize import W4A4Parts
from porting.tensors.reader import read_stored


class NotExact(Exception):
    """The pieces cannot be joined into one layer without requantizing; the message says why."""


@dataclass
class Logical:
    kind: str  # "w4a4" | "awq"
    precision: str  # int4 | nvfp4
    codes: torch.Tensor  # (n, k) uint8 nibbles
    scales: torch.Tensor  # int4 / awq (n, k/64) 16-bit; nvfp4 (n, k/16) float8_e4m3fn
    zeros: torch.Tensor | None = None  # awq (n, k/64)
    rows: torch.Tensor | None = None  # nvfp4 row scales wtscale·wcscales, float32 (n,)
    smooth: torch.Tensor | None = None  # (k,) 16-bit
    down: torch.Tensor | None = None  # (r, k)
    up: torch.Tensor | None = None  # (n, r)

    @property
    def n(self) -> int:
        return self.codes.shape[0]

    @property
    def k(self) -> int:
        return self.codes.shape[1]

    @property
    def rank(self) -> int:
        return 0 if self.down is None else self.down.shape[0]


def unpack(layer: SvdqLayer) -> Logical:
    """A stored layer's logical parts (AWQ rows de-interleaved)."""
    parts, n, k = layer.parts, layer.n, layer.k
    if layer.kind == "awq":
        s, groups = max(layer.awq_splits, 1), k // 64
        codes = P.deinterleave_rows(P.unpack_awq_codes(read_stored(parts["qweight"]), n, k), s).to(torch.uint8)
        scales = P.deinterleave_rows(read_stored(parts["wscales"])[:groups].t(), s).contiguous()
        zeros = P.deinterleave_rows(read_stored(parts["wzeros"])[:groups].t(), s).contiguous()
        return Logical("awq", "int4", codes, scales, zeros)
    codes = P.unpack_codes(read_stored(parts["qweight"]), n, k).to(torch.uint8)
    rows = None
    if layer.precision == "nvfp4":
        scales = P.unpack_micro_scales(read_stored(parts["wscales"]), n, k)
        rows = torch.ones(n)
        if "wtscale" in parts:
            rows = rows * read_stored(parts["wtscale"]).float().reshape(-1)[0]
        if "wcscales" in parts:
            rows = rows * P.unpack_vector(read_stored(parts["wcscales"])).float()
    else:
        scales = P.unpack_scales(read_stored(parts["wscales"]), n, k // 64)
    smooth = (P.unpack_vector(read_stored(parts["smooth"])) if "smooth" in parts
              else torch.ones(k, dtype=torch.bfloat16))
    down = up = None
    if "lora_down" in parts:
        down = P.unpack_lowrank(read_stored(parts["lora_down"]), down=True)[:, :k]
        up = P.unpack_lowrank(read_stored(parts["lora_up"]), down=False)[:n]
    return compact(Logical("w4a4", layer.precision, codes, scales, None, rows, smooth, down, up))


def from_parts(q: W4A4Parts, precision: str, pieces: list[int]) -> Logical:
    """A freshly quantized layer (`quantize.quantize_w4a4`) as logical parts."""
    rows = None
    if precision == "nvfp4":
        assert q.tensor_scales is not None
        rows = torch.cat([q.tensor_scales[i:i + 1].float().expand(m) for i, m in enumerate(pieces)])
    return compact(Logical("w4a4", precision, q.codes, q.scales, None, rows, q.smooth, q.down, q.up))


def compact(lg: Logical) -> Logical:
    """Rank components that add nothing (a zero column of U or row of D) dropped."""
    if lg.down is None:
        return lg
    keep = (lg.up != 0).any(dim=0) & (lg.down != 0).any(dim=1)
    if bool(keep.all()):
        return lg
    return replace(lg, down=lg.down[keep], up=lg.up[:, keep])


def rows(lg: Logical, a: int, b: int) -> Logical:
    return replace(lg, codes=lg.codes[a:b], scales=lg.scales[a:b],
                   zeros=None if lg.zeros is None else lg.zeros[a:b], rows=None if lg.rows is None else lg.rows[a:b],
                   up=None if lg.up is None else lg.up[a:b])


def columns(lg: Logical, a: int, b: int) -> Logical:
    g = lg.k // lg.scales.shape[1]
    return replace(lg, codes=lg.codes[:, a:b], scales=lg.scales[:, a // g:b // g],
                   zeros=None if lg.zeros is None else lg.zeros[:, a // g:b // g],
                   smooth=None if lg.smooth is None else lg.smooth[a:b],
                   down=None if lg.down is None else lg.down[:, a:b])


def _same(ts: list[torch.Tensor | None]) -> bool:
    first = ts[0]
    return all((t is None) == (first is None) and (t is None or (t.shape == first.shape and torch.equal(t, first)))
               for t in ts[1:])


def _branches(lgs: list[Logical]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(down, up) of each piece, a zero branch of rank 0 where a piece has none."""
    return [(lg.down, lg.up) if lg.down is not None else (lg.codes.new_zeros((0, lg.k), dtype=torch.bfloat16),
                                                          lg.codes.new_zeros((lg.n, 0), dtype=torch.bfloat16))
            for lg in lgs]


def _w4a4_only(lgs: list[Logical], name: str) -> Logical:
    """The first piece, once every piece is SVDQuant W4A4 (AWQ W4A16 pieces are not joined)."""
    if any(lg.kind != "w4a4" for lg in lgs):
        raise NotExact(f"{name}: only SVDQuant W4A4 pieces are joined")
    return lgs[0]


def join_rows(lgs: list[Logical], name: str) -> Logical:
    """Pieces reading the same input, their outputs stacked."""
    if len(lgs) == 1:
        return lgs[0]
    first = _w4a4_only(lgs, name)
    if not _same([lg.smooth for lg in lgs]):
        raise NotExact(f"{name}: its pieces have different smoothing factors (one layer has one)")
    branches = _branches(lgs)
    if _same([d for d, _ in branches]):
        down, up = branches[0][0], torch.cat([u for _, u in branches])
    else:
        down = torch.cat([d for d, _ in branches])
        up = torch.block_diag(*[u for _, u in branches])
    return compact(Logical("w4a4", first.precision, torch.cat([lg.codes for lg in lgs]),
                           torch.cat([lg.scales for lg in lgs]), None,
                           None if first.rows is None else torch.cat([lg.rows for lg in lgs]),
                           first.smooth, down, up))


def join_columns(lgs: list[Logical], name: str) -> Logical:
    """Pieces reading consecutive input columns, their outputs added."""
    if len(lgs) == 1:
        return lgs[0]
    first = _w4a4_only(lgs, name)
    if first.rows is not None and not _same([lg.rows for lg in lgs]):
        raise NotExact(f"{name}: its nvfp4 pieces have different per-tensor scales (one layer has one per row)")
    branches = _branches(lgs)
    if _same([u for _, u in branches]):
        down, up = torch.cat([d for d, _ in branches], dim=1), branches[0][1]
    else:
        up = torch.cat([u for _, u in branches], dim=1)
        down = torch.block_diag(*[d for d, _ in branches])
    return compact(Logical("w4a4", first.precision, torch.cat([lg.codes for lg in lgs], dim=1),
                           torch.cat([lg.scales for lg in lgs], dim=1), None, first.rows,
                           torch.cat([lg.smooth for lg in lgs]), down, up))


def residual_rowsum(lg: Logical) -> torch.Tensor:
    """Row sums of R·diag(1/s) in float32 (the int4 GELU-shift bias correction), as decode.py computes them."""
    values = P.byte_values(lg.precision).index_select(0, P.code_bytes(lg.codes).reshape(-1).int()).reshape(lg.n, -1)
    g = lg.k // lg.scales.shape[1]
    r = values.view(lg.n, -1, g).mul_(lg.scales.float()[:, :, None]).view(lg.n, lg.k)
    if lg.rows is not None:
        r.mul_(lg.rows[:, None])
    return r.div_(lg.smooth.float()).sum(dim=1)


def bf16_exact(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t` (float32) as bf16, refused (NotExact) when that rounds."""
    out = t.to(torch.bfloat16)
    if not torch.equal(out.float(), t.float()):
        raise NotExact(f"{what} is not a bf16 value")
    return out


Branch = tuple[torch.Tensor, torch.Tensor]  # D (r, k), U (n, r)


def pack(lg: Logical, scale_roles: tuple[str, ...], awq_splits: int = 1) -> tuple[dict[str, torch.Tensor],
                                                                                  Branch | None]:
    """The stored tensors by role but the bias and the branch, and the branch (None: AWQ), which `pack_branch`
    packs once the layout's one rank is known; `scale_roles`: which of wtscale / wcscales the layout stores for
    this layer (nvfp4)."""
    if lg.kind == "awq":
        s = max(awq_splits, 1)
        return {"qweight": P.pack_awq_codes(P.interleave_rows(lg.codes, s)),
                "wscales": P.interleave_rows(lg.scales, s).t().contiguous(),
                "wzeros": P.interleave_rows(lg.zeros, s).t().contiguous()}, None
    out = {"qweight": P.pack_codes(lg.codes)}
    if lg.precision == "nvfp4":
        out["wscales"] = P.pack_micro_scales(lg.scales)
        out.update(_row_scales(lg.rows, scale_roles))
    else:
        out["wscales"] = P.pack_scales(lg.scales)
    out["smooth"] = P.pack_vector(lg.smooth)
    return out, _branches([lg])[0]


def pack_branch(branch: Branch, rank: int) -> dict[str, torch.Tensor]:
    """`lora_down` and `lora_up` padded with zeros to `rank`."""
    down, up = branch
    return {"lora_down": P.pack_lowrank(P.pad_rank(down, rank, 0).to(torch.bfloat16), True),
            "lora_up": P.pack_lowrank(P.pad_rank(up, rank, 1).to(torch.bfloat16), False)}


def _row_scales(rows: torch.Tensor, roles: tuple[str, ...]) -> dict[str, torch.Tensor]:
    uniform = bool((rows == rows[0]).all())
    if roles == ("wtscale",):
        if not uniform:
            raise NotExact("its nvfp4 row scales differ and the layer stores one per-tensor scale")
        return {"wtscale": bf16_exact(rows[:1], "its per-tensor scale")}
    if roles == ("wcscales",):
        return {"wcscales": P.pack_vector(bf16_exact(rows, "its per-row scale"))}
    if uniform:
        return {"wtscale": bf16_exact(rows[:1], "its per-tensor scale"),
                "wcscales": P.pack_vector(torch.ones_like(rows, dtype=torch.bfloat16))}
    return {"wtscale": torch.ones(1, dtype=torch.bfloat16),
            "wcscales": P.pack_vector(bf16_exact(rows, "its per-row scale"))}


__all__ = ["NotExact", "Logical", "unpack", "from_parts", "compact", "rows", "columns", "join_rows", "join_columns",
           "residual_rowsum", "bf16_exact", "pack", "pack_branch", "Branch"]
