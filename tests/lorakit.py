"""Adapter files in every common naming, and their weight differences computed by the test's own arithmetic.

An adapter here is a list of `Part`s: one module (BFL or diffusers name), its kind and its factors. Writers lay
the parts out in each naming's keys; `bfl_deltas` gives what the adapter must add to each BFL weight, with a
hand-written diffusers -> BFL placement for the handful of modules used (independent of mappings/flux2.toml).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors.torch import save_file

from .helpers import TINY2

# the modules the issue asks for: fused qkv, linear1, a modulation, img_in, final adaLN (plus an MLP and linear2)
BFL_MODULES = ["double_blocks.0.img_attn.qkv", "double_blocks.1.txt_attn.qkv", "single_blocks.0.linear1",
               "double_stream_modulation_img.lin", "img_in", "final_layer.adaLN_modulation.1",
               "double_blocks.1.img_mlp.0", "single_blocks.1.linear2"]
DIFFUSERS_MODULES = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k",
                     "transformer_blocks.0.attn.to_v", "transformer_blocks.1.attn.add_k_proj",
                     "single_transformer_blocks.0.attn.to_qkv_mlp_proj", "double_stream_modulation_img.linear",
                     "x_embedder", "norm_out.linear", "transformer_blocks.1.ff.linear_in"]


@dataclass
class Part:
    module: str
    kind: str  # lora, lokr, loha, diff
    factors: dict[str, torch.Tensor]
    alpha: float | None = None

    def delta(self) -> torch.Tensor:
        """The test's own arithmetic (community-formats.md section 3)."""
        f = self.factors
        if self.kind == "lora":
            r = f["down"].shape[0]
            return (1.0 if self.alpha is None else self.alpha / r) * f["up"] @ f["down"]
        if self.kind == "lokr":
            w2 = f["w2"] if "w2" in f else f["w2_a"] @ f["w2_b"]
            s = 1.0 if self.alpha is None or "w2_b" not in f else self.alpha / f["w2_b"].shape[0]
            return s * torch.kron(f["w1"], w2)
        if self.kind == "loha":
            s = 1.0 if self.alpha is None else self.alpha / f["w1_b"].shape[0]
            return s * (f["w1_a"] @ f["w1_b"]) * (f["w2_a"] @ f["w2_b"])
        return f["diff"]


def weight_shapes(state: Mapping[str, torch.Tensor], diffusers: bool) -> dict[str, tuple[int, int]]:
    """Module -> [out, in] of the reference model, in BFL or (for the modules used) diffusers naming."""
    shapes = {k[: -len(".weight")]: tuple(v.shape) for k, v in state.items() if k.endswith(".weight")}
    if not diffusers:
        return shapes
    out = {}
    for module in DIFFUSERS_MODULES:
        bfl, rows = to_bfl(module)
        o, i = shapes[bfl]
        out[module] = (o if rows is None else rows[1] - rows[0], i)
    return out


def to_bfl(module: str, hidden: int = TINY2.hidden) -> tuple[str, tuple[int, int] | None]:
    """(BFL module, row range of it or None for all rows) for the diffusers modules used here."""
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)", module)
    if m:
        n, proj = m.groups()
        stream = "txt" if proj.startswith("add_") else "img"
        i = "qkv".index(proj[4] if proj.startswith("add_") else proj[-1])
        return f"double_blocks.{n}.{stream}_attn.qkv", (i * hidden, (i + 1) * hidden)
    fixed = {"double_stream_modulation_img.linear": "double_stream_modulation_img.lin", "x_embedder": "img_in",
             "norm_out.linear": "final_layer.adaLN_modulation.1"}
    if module in fixed:
        return fixed[module], None
    m = re.fullmatch(r"single_transformer_blocks\.(\d+)\.attn\.to_qkv_mlp_proj", module)
    if m:
        return f"single_blocks.{m.group(1)}.linear1", None
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.ff\.linear_in", module)
    if m:
        return f"double_blocks.{m.group(1)}.img_mlp.0", None
    raise KeyError(module)


def bfl_deltas(parts: list[Part], state: Mapping[str, torch.Tensor], diffusers: bool,
               strength: float = 1.0) -> dict[str, torch.Tensor]:
    """BFL weight key -> strength * delta, placed by hand."""
    out: dict[str, torch.Tensor] = {}
    for p in parts:
        d = strength * p.delta()
        module, rows = to_bfl(p.module) if diffusers else (p.module, None)
        key = module + ".weight"
        if diffusers and p.module == "norm_out.linear":  # diffusers rows (scale, shift) -> BFL (shift, scale)
            scale, shift = d.chunk(2)
            d = torch.cat([shift, scale])
        total = out.setdefault(key, torch.zeros_like(state[key]))
        if rows is None:
            total += d
        else:
            total[rows[0]:rows[1]] += d
    return out


def make_parts(shapes: Mapping[str, tuple[int, int]], modules: list[str], kind: str, seed: int = 0,
               alpha: float | None = None, rank: int = 3) -> list[Part]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, fan: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / math.sqrt(fan)

    parts = []
    for module in modules:
        o, i = shapes[module]
        if kind == "lora":
            f = {"down": rnd(rank, i, fan=i), "up": 0.5 * rnd(o, rank, fan=rank)}
        elif kind == "lokr":
            a = 12 if module.endswith(".qkv") else 4  # 12 rows: splits exactly into q/k/v
            f = {"w1": rnd(a, 4, fan=4), "w2_a": rnd(o // a, 2, fan=2), "w2_b": 0.5 * rnd(2, i // 4, fan=i // 4)}
        elif kind == "loha":
            f = {"w1_a": rnd(o, 2, fan=2), "w1_b": rnd(2, i, fan=i), "w2_a": rnd(o, 2, fan=2),
                 "w2_b": rnd(2, i, fan=1)}
        else:
            f = {"diff": 0.3 * rnd(o, i, fan=i)}
        parts.append(Part(module, kind, f, alpha))
    return parts


KeyFn = Callable[[str, str], str]  # (module, role) -> key


def _under(head: str, suffixes: Mapping[str, str]) -> KeyFn:
    return lambda module, role: head + module.replace(".", "_") + "." + suffixes[role]


def _dotted(prefix: str, suffixes: Mapping[str, str]) -> KeyFn:
    return lambda module, role: prefix + module + "." + suffixes[role]


DOWN_UP = {"down": "lora_down.weight", "up": "lora_up.weight", "alpha": "alpha"}
A_B = {"down": "lora_A.weight", "up": "lora_B.weight", "alpha": "alpha"}
LOKR = {r: f"lokr_{r}" for r in ("w1", "w1_a", "w1_b", "w2", "w2_a", "w2_b")} | {"alpha": "alpha"}
LOHA = {r: f"hada_{r}" for r in ("w1_a", "w1_b", "w2_a", "w2_b")} | {"alpha": "alpha"}


@dataclass(frozen=True)
class Naming:
    name: str
    diffusers_modules: bool
    kind: str
    key: KeyFn
    alpha: float | None  # None: the naming carries no alpha (scale 1)


NAMINGS = [
    Naming("kohya", False, "lora", _under("lora_unet_", DOWN_UP), 1.5),
    Naming("bfl-lora_A", False, "lora", _dotted("diffusion_model.", A_B), None),
    Naming("bfl-down-up", False, "lora", _dotted("diffusion_model.", DOWN_UP), 6.0),
    Naming("peft-transformer", True, "lora", _dotted("transformer.", A_B), None),
    Naming("peft-base_model", True, "lora", _dotted("base_model.model.", A_B), None),
    Naming("lycoris-lokr", True, "lokr", _under("lycoris_", LOKR), 1.0),
    Naming("bfl-lokr", False, "lokr", _dotted("diffusion_model.", LOKR), 3.0),
    Naming("kohya-loha", False, "loha", _under("lora_unet_", LOHA), 1.0),
    Naming("comfy-diff", False, "diff", _dotted("diffusion_model.", {"diff": "diff"}), None),
]
BY_NAME = {n.name: n for n in NAMINGS}


def write_adapter(path: Path, naming: Naming, parts: list[Part], extra: Mapping[str, torch.Tensor] | None = None,
                  dtype: torch.dtype = torch.float32) -> Path:
    tensors: dict[str, torch.Tensor] = {}
    for p in parts:
        for role, t in p.factors.items():
            tensors[naming.key(p.module, role)] = t.to(dtype).contiguous()
        if p.alpha is not None:
            tensors[naming.key(p.module, "alpha")] = torch.tensor(p.alpha)
    tensors.update(extra or {})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def adapter_for(path: Path, naming: Naming, state: Mapping[str, torch.Tensor], seed: int = 0,
                modules: list[str] | None = None) -> tuple[Path, list[Part]]:
    shapes = weight_shapes(state, naming.diffusers_modules)
    modules = modules or (DIFFUSERS_MODULES if naming.diffusers_modules else BFL_MODULES)
    parts = make_parts(shapes, modules, naming.kind, seed=seed, alpha=naming.alpha)
    return write_adapter(path, naming, parts), parts
