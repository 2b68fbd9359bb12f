"""What an SVDQuant header says, as data (no torch): layers, how they make diffusers tensors, the file's facts.

Shared by the header reader (`reader.py`), the decoder (`decode.py`) and the packed runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from porting.tensors.reader import TensorInfo, read_bytes

GELU_SHIFT = 0.171875  # Nunchaku's SHIFT_GELU: int4 inputs of GELU down-projections are GELU(x) + this, unsigned


@dataclass(frozen=True)
class SvdqLayer:
    """One stored quantized linear: its parts by role, its logical (out, in) size."""

    prefix: str  # stored prefix, ending in '.'
    kind: str  # "w4a4" (SVDQuant) or "awq" (AWQ W4A16, the FLUX.1 adaLN layers)
    parts: Mapping[str, TensorInfo]
    n: int
    k: int
    precision: str  # int4 | nvfp4 (of the file; AWQ layers are int4 whatever it is)
    gelu_shift: bool = False
    awq_splits: int = 0

    @property
    def rank(self) -> int:
        down = self.parts.get("lora_down")
        return down.shape[1] if down is not None else 0

    @property
    def smoothing_fused(self) -> bool:
        """True when `smooth` is all ones and `smooth_orig` is not: s was folded into the previous layer."""
        s, orig = self.parts.get("smooth"), self.parts.get("smooth_orig")
        return s is not None and orig is not None and all_ones(s) and not all_ones(orig)


@dataclass(frozen=True)
class Piece:
    layer: SvdqLayer
    rows: tuple[int, int]  # the rows of the layer's effective weight this piece uses


@dataclass(frozen=True)
class Target:
    """A diffusers tensor made from stored layers: `weight` or `bias`, rows stacked or columns side by side."""

    key: str
    role: str
    join: str  # "rows" | "columns"
    pieces: tuple[Piece, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        if self.join == "columns":
            n = self.pieces[0].rows[1] - self.pieces[0].rows[0]
            return (n, sum(p.layer.k for p in self.pieces)) if self.role == "weight" else (n,)
        n = sum(p.rows[1] - p.rows[0] for p in self.pieces)
        return (n, self.pieces[0].layer.k) if self.role == "weight" else (n,)


@dataclass
class SvdqFile:
    """What a header says about an SVDQuant file (no torch)."""

    family: str
    precision: str
    group_size: int
    rank: int
    layers: dict[str, SvdqLayer] = field(default_factory=dict)  # stored prefix -> layer
    targets: dict[str, Target] = field(default_factory=dict)  # diffusers key -> how it is made
    renamed: dict[str, str] = field(default_factory=dict)  # stored key -> diffusers key (16-bit tensors)
    consumed: set[str] = field(default_factory=set)
    dropped: list[str] = field(default_factory=list)
    config: dict | None = None
    spelling: str = ""
    layout: str = "nunchaku"  # "nunchaku" (Nunchaku's own file) | "diffusers" (diffusers' Nunchaku Lite folder)
    plain_linears: int = 0  # 2-D weights stored in 16 bits (embedders, modulation, final layer)
    written_by: dict | None = None  # flux-port's own record in the metadata: how the file was quantized
    merged: list = field(default_factory=list)  # adapters `port merge` appended to the branch (or folded in)

    @property
    def label(self) -> str:
        return f"SVDQuant {self.precision}, rank {self.rank}, group {self.group_size}"

    def counts(self) -> dict[str, int]:
        """Dequantized (computed) diffusers tensors, weights and biases, by the kind of layer they come from."""
        w4a4 = f"W4A4 {self.precision} g{self.group_size} + rank-{self.rank} branch"
        out: dict[str, int] = {}
        for target in self.targets.values():
            name = w4a4 if target.pieces[0].layer.kind == "w4a4" else "W4A16 AWQ int4 g64 (adaLN)"
            out[name] = out.get(name, 0) + 1
        return out


def all_ones(info: TensorInfo) -> bool:
    one = {"BF16": b"\x80\x3f", "F16": b"\x00\x3c"}.get(info.dtype)
    return one is not None and read_bytes(info) == one * info.numel



__all__ = ["GELU_SHIFT", "SvdqLayer", "Piece", "Target", "SvdqFile", "all_ones"]
