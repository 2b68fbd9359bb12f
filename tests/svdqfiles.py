"""Tiny Nunchaku SVDQuant checkpoints whose bytes come from deepcompressor's own converter (the oracle).

deepcompressor (PyPI `deepcompressor-toolkit==0.1.0`, installed `--no-deps`) is the code that produced the published
SVDQuant checkpoints. Here it packs every quantized layer: this module only prepares the converter's INPUTS the way
deepcompressor's PTQ leaves them (`model.pt` weights = the 4-bit residual R already on the quantization grid, in bf16;
`scale.pt`, `smooth.pt`, `branch.pt`), calls `convert_to_nunchaku_flux_state_dicts` (FLUX.1) or the generic
`convert_to_nunchaku_transformer_block_state_dict` with FLUX.2 name maps (FLUX.2 has no published converter), and
saves what it returns. Nothing is packed here and flux-port's readers are never used.

The oracle (`SvdqFixture.expected`) is computed in float64 from those inputs, mirroring the converter's own rounding
(weight / scale in float32 then round, or `fp_quantize` for nvfp4; lora_down / s in float64 then bf16; the shift bias
in float64 then bf16; AWQ q = round((w + 7 s) / s) and wzeros = -bf16(7 s); the +1 on the adaLN scale slots in bf16),
then the kernel's equations (/work/shared/svdquant.md section 4):

    W_eff = R · diag(1 / s_file) + U · D_file          (R = codes × scales, D_file = lora_down as written)
    b_eff = b_file (+ 0.171875 · rowsum(R · diag(1 / s_file)) for the int4 FLUX.1 GELU down-projections)

Fused smoothing (`smooth_fused=True`, deepcompressor's `proj.fuse_when_possible`): the V rows (and V bias) that feed
each out-projection were divided by that out-projection's s before quantization, the out-projection was quantized
from W_out · diag(s) with lora_down NOT divided by s, and the file carries smooth = ones, smooth_orig = s. `expected`
is then still the network the kernel runs (W_eff of V ≈ W_v / s, W_eff of out ≈ W_out · diag(s)); `unfused()` undoes
the fusion (V rows × s, out columns ÷ s) for a per-tensor comparison with `original` (svdquant.md section 4).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch

from porting.skeleton import diffusers_skeleton

SHIFT = 0.171875  # deepcompressor's GELU shift (ShiftedLinear), the kernel's SHIFT_GELU
BF16 = torch.bfloat16
F64 = torch.float64
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=F64)  # deepcompressor's fp_quantize codebook: index = the 4-bit code

FLUX1_CONFIG = {
    "_class_name": "FluxTransformer2DModel", "patch_size": 1, "in_channels": 16, "out_channels": None,
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 64, "num_attention_heads": 2,
    "joint_attention_dim": 32, "pooled_projection_dim": 24, "guidance_embeds": True, "axes_dims_rope": [16, 24, 24],
}
FLUX2_CONFIG = {
    "_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 16, "out_channels": None,
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 64, "num_attention_heads": 2,
    "joint_attention_dim": 48, "timestep_guidance_channels": 256, "mlp_ratio": 3.0,
    "axes_dims_rope": [16, 16, 16, 16], "rope_theta": 2000, "eps": 1e-6, "guidance_embeds": False,
}
KLEIN9B_CONFIG = {**FLUX2_CONFIG, "in_channels": 128, "num_layers": 8, "num_single_layers": 24,
                  "attention_head_dim": 128, "num_attention_heads": 32, "joint_attention_dim": 12288,
                  "axes_dims_rope": [32, 32, 32, 32]}

MODEL_CLASS = {"flux1": "NunchakuFluxTransformer2dModel",  # nunchaku merge_safetensors.py
               "flux2": "NunchakuFlux2Transformer2DModel"}  # tonera/nunchaku transformer_flux2.py (capital D)

# FLUX.2 converter-name -> module-name maps (tonera/nunchaku transformer_flux2.py, nunchaku_lite adapters/flux2.py)
FLUX2_DOUBLE_MODULES = {
    "qkv_proj": "attn.to_qkv", "qkv_proj_context": "attn.to_added_qkv", "out_proj": "attn.to_out.0",
    "out_proj_context": "attn.to_add_out", "mlp_fc1": "ff.linear_in", "mlp_fc2": "ff.linear_out",
    "mlp_context_fc1": "ff_context.linear_in", "mlp_context_fc2": "ff_context.linear_out",
    "norm_q": "attn.norm_q", "norm_k": "attn.norm_k", "norm_added_q": "attn.norm_added_q",
    "norm_added_k": "attn.norm_added_k",
}
FLUX2_SINGLE_MODULES = {"qkv_proj": "attn.qkv_proj", "mlp_fc1": "attn.mlp_fc1", "out_proj": "attn.out_proj",
                        "mlp_fc2": "attn.mlp_fc2", "norm_q": "attn.norm_q", "norm_k": "attn.norm_k"}
MODULE_PARTS = {"lora_down": "proj_down", "lora_up": "proj_up", "smooth": "smooth_factor",
                "smooth_orig": "smooth_factor_orig"}

# FLUX.2 name maps handed to deepcompressor's generic block converter (the FLUX.1 ones, moved to FLUX.2 modules).
# The single block's fused diffusers linears are split beforehand into attn.qkv_proj / attn.mlp_fc1 (rows of
# attn.to_qkv_mlp_proj) and attn.out_proj / attn.mlp_fc2 (columns of attn.to_out).
FLUX2_DOUBLE_MAPS = dict(
    local_name_map={
        "qkv_proj": ["attn.to_q", "attn.to_k", "attn.to_v"],
        "qkv_proj_context": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
        "norm_q": "attn.norm_q", "norm_k": "attn.norm_k", "norm_added_q": "attn.norm_added_q",
        "norm_added_k": "attn.norm_added_k", "out_proj": "attn.to_out.0", "out_proj_context": "attn.to_add_out",
        "mlp_fc1": "ff.linear_in", "mlp_fc2": "ff.linear_out",
        "mlp_context_fc1": "ff_context.linear_in", "mlp_context_fc2": "ff_context.linear_out",
    },
    smooth_name_map={
        "qkv_proj": "attn.to_q", "qkv_proj_context": "attn.add_k_proj", "out_proj": "attn.to_out.0",
        "out_proj_context": "attn.to_out.0", "mlp_fc1": "ff.linear_in", "mlp_fc2": "ff.linear_out",
        "mlp_context_fc1": "ff_context.linear_in", "mlp_context_fc2": "ff_context.linear_out",
    },
    branch_name_map={
        "qkv_proj": "attn.to_q", "qkv_proj_context": "attn.add_k_proj", "out_proj": "attn.to_out.0",
        "out_proj_context": "attn.to_add_out", "mlp_fc1": "ff.linear_in", "mlp_fc2": "ff.linear_out",
        "mlp_context_fc1": "ff_context.linear_in", "mlp_context_fc2": "ff_context.linear_out",
    },
    convert_map={k: "linear" for k in ("qkv_proj", "qkv_proj_context", "out_proj", "out_proj_context", "mlp_fc1",
                                       "mlp_fc2", "mlp_context_fc1", "mlp_context_fc2")},
)
FLUX2_SINGLE_MAPS = dict(
    local_name_map={"qkv_proj": "attn.qkv_proj", "norm_q": "attn.norm_q", "norm_k": "attn.norm_k",
                    "out_proj": "attn.out_proj", "mlp_fc1": "attn.mlp_fc1", "mlp_fc2": "attn.mlp_fc2"},
    smooth_name_map={"qkv_proj": "attn.qkv_proj", "out_proj": "attn.out_proj", "mlp_fc1": "attn.qkv_proj",
                     "mlp_fc2": "attn.mlp_fc2"},
    branch_name_map={"qkv_proj": "attn.qkv_proj", "out_proj": "attn.out_proj", "mlp_fc1": "attn.mlp_fc1",
                     "mlp_fc2": "attn.mlp_fc2"},
    convert_map={k: "linear" for k in ("qkv_proj", "out_proj", "mlp_fc1", "mlp_fc2")},
)

BLOCK_PREFIXES = ("transformer_blocks.", "single_transformer_blocks.")


@dataclass
class SvdqFixture:
    files: list[Path]  # the .safetensors written (1 single file, or transformer_blocks + unquantized_layers)
    path: Path  # what a user passes: the file, or the folder of the split pair
    family: str  # "flux1" | "flux2"
    precision: str  # "int4" | "nvfp4"
    rank: int
    config: dict  # the tiny diffusers config, with "_class_name"
    expected: dict[str, torch.Tensor]  # diffusers-named float32 weights the kernel multiplies by (module docstring)
    original: dict[str, torch.Tensor]  # the float32 diffusers weights before quantization (bf16-representable)
    # Extras (not part of the requested API):
    metadata: dict[str, str] = field(default_factory=dict)  # the safetensors metadata written ({} when none)
    # logical (unpacked) content of every packed tensor, keyed by its key in the file, from the converter's inputs:
    # qweight -> codes (n, k) (int4: int8 -8..7; nvfp4: uint8 E2M1 index), wscales -> (n, k/64) bf16 or
    # (n, k/16) float8_e4m3fn, wtscale (1,), wcscales (n,), bias / smooth / smooth_orig vectors, lora_down -> (r, k),
    # lora_up -> (n, r); AWQ (FLUX.1 adaLN, rows in the file's interleaved order): qweight codes 0..15 (n, k),
    # wscales / wzeros (n, k/64), bias (with the +1)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    # fused smoothing: (out-projection weight key, its column slice, [(V key, row slice)], s) per fused out-projection
    fusion: list[tuple[str, slice, list[tuple[str, slice]], torch.Tensor]] = field(default_factory=list)

    def unfused(self) -> dict[str, torch.Tensor]:
        """`expected` with fused smoothing undone (V rows and biases × s, out-projection columns ÷ s)."""
        out = dict(self.expected)
        for out_key, cols, vs, s in self.fusion:
            w = out[out_key].clone()
            w[:, cols] = w[:, cols] / s.float()
            out[out_key] = w
            for v_key, rows in vs:
                for key in (v_key, v_key[: -len("weight")] + "bias"):
                    if key in out:
                        t = out[key].clone()
                        t[rows] = t[rows] * (s.float().view(-1, 1) if t.ndim == 2 else s.float())
                        out[key] = t
        return out


# ----------------------------------------------------------------------------------------------------------------
# quantization of one residual to the 4-bit grid, mirroring the converter's own rounding


def _quantize(rc: torch.Tensor, precision: str) -> dict[str, torch.Tensor | None]:
    """Put the float64 residual on the grid; return the converter inputs and what the converter will encode."""
    from deepcompressor.backend.utils import fp_quantize

    n, k = rc.shape
    if precision == "int4":
        g = rc.view(n, k // 64, 64)
        scale = (g.abs().amax(-1) / 7).clamp_min(2.0**-24).to(BF16)  # (n, k/64)
        codes = torch.round(g / scale.to(F64).unsqueeze(-1)).clamp(-7, 7)
        weight = (codes * scale.to(F64).unsqueeze(-1)).view(n, k).to(BF16)
        # convert_to_nunchaku_w4x4y16_linear_weight: weight.float32 / scale.float32, round_()
        mirrored = (weight.to(torch.float32).view(n, 1, k // 64, 64) / scale.to(torch.float32).view(n, 1, -1, 1))
        mirrored = mirrored.round_().view(n, k)
        assert torch.equal(mirrored, codes.view(n, k).to(torch.float32)), "int4 codes do not survive the converter"
        deq = (mirrored.to(F64).view(n, k // 64, 64) * scale.to(F64).unsqueeze(-1)).view(n, k)
        return {"weight": weight, "scale": scale.view(n, 1, k // 64, 1), "subscale": None,
                "codes": mirrored.to(torch.int8), "deq": deq, "wscales": scale, "t": None}
    t = (rc.abs().max() / (6 * 448)).clamp_min(2.0**-60).to(BF16).view(1)  # per-tensor scale.0 (wtscale)
    g = rc.view(n, k // 16, 16)
    sub = (g.abs().amax(-1) / 6 / t.to(F64)).clamp(2.0**-9, 448).to(torch.float32).to(torch.float8_e4m3fn)
    subd = sub.to(F64).unsqueeze(-1)
    x = g / (subd * t.to(F64))
    values = E2M1[(x.unsqueeze(-1) - E2M1).abs().argmin(-1)]
    weight = (values * subd * t.to(F64)).view(n, k).to(BF16)
    # convert_to_nunchaku_w4x4y16_linear_weight: weight.float32 / scale.0 / scale.1 (float32), fp_quantize
    w32 = weight.to(torch.float32).view(n, 1, 1, k).div_(t.to(torch.float32).view(-1).expand(n).reshape(n, 1, 1, 1))
    w32 = w32.view(n, 1, k // 16, 16).div_(sub.to(BF16).to(torch.float32).view(n, 1, k // 16, 1)).view(n, k)
    idx = fp_quantize(w32)
    assert torch.equal(E2M1[idx], values.view(n, k)), "fp4 codes do not survive the converter"
    deq = (E2M1[idx].view(n, k // 16, 16) * subd * t.to(F64)).view(n, k)
    return {"weight": weight, "scale": t.view(1, 1, 1, 1), "subscale": sub.to(BF16).view(n, 1, k // 16, 1),
            "codes": idx.to(torch.uint8), "deq": deq, "wscales": sub, "t": t}


def _lowrank(ws: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-r SVD of W·diag(s): U (n, r) and D (r, k) in bf16, the singular values split evenly."""
    u, sv, vh = torch.linalg.svd(ws, full_matrices=False)
    r = min(rank, sv.numel())
    root = sv[:r].sqrt()
    return (u[:, :r] * root).to(BF16), (root[:, None] * vh[:r]).to(BF16)


# ----------------------------------------------------------------------------------------------------------------
# converter inputs + oracle, layer by layer


class _Inputs:
    """deepcompressor's PTQ outputs (model.pt, scale.pt, smooth.pt, branch.pt) plus the oracle built beside them."""

    def __init__(self, precision: str, rank: int, fused: bool, gen: torch.Generator) -> None:
        self.precision, self.rank, self.fused, self.gen = precision, rank, fused, gen
        self.state: dict[str, torch.Tensor] = {}
        self.scale: dict[str, torch.Tensor] = {}
        self.smooth: dict[str, object] = {"proj.fuse_when_possible": fused}
        self.branch: dict[str, dict[str, torch.Tensor]] = {}
        self.expected: dict[str, torch.Tensor] = {}
        self.parts: dict[str, torch.Tensor] = {}  # converter names: "{block}.{local}.{part}"
        self.fusion: list[tuple[str, slice, list[tuple[str, slice]], torch.Tensor]] = []

    def smooth_vector(self, key: str, k: int) -> torch.Tensor:
        if key not in self.smooth:
            self.smooth[key] = (0.5 + torch.rand(k, generator=self.gen, dtype=F64)).to(BF16)
        return self.smooth[key]  # type: ignore[return-value]

    def copy(self, name: str, value: torch.Tensor, expected_key: str | None = None) -> None:
        """A tensor the converter copies as is (norms, everything outside the blocks)."""
        self.state[name] = value.to(BF16)
        self.expected[expected_key or name] = value.to(F64)

    def svdq(self, block: str, local: str, cands: list[str], weights: list[torch.Tensor],
             biases: list[torch.Tensor | None], smooth_key: str, branch_key: str, shift_key: str | None = None,
             out_proj: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One W4A4 layer (fused pieces in row order): converter inputs for it, and its (W_eff, b_eff) in float64."""
        w = torch.cat([x.to(F64) for x in weights])
        n, k = w.shape
        s = self.smooth_vector(f"{block}.{smooth_key}", k)
        sd = s.to(F64)
        ws = w * sd
        up, down = _lowrank(ws, self.rank)
        rc = ws - up.to(F64) @ down.to(F64)
        deq, codes, wscales, ts, row = [], [], [], [], 0
        for cand, piece in zip(cands, weights):
            q = _quantize(rc[row: row + piece.shape[0]], self.precision)
            self.state[f"{cand}.weight"] = q["weight"]
            self.scale[f"{cand}.weight.scale.0"] = q["scale"]
            if q["subscale"] is not None:
                self.scale[f"{cand}.weight.scale.1"] = q["subscale"]
            deq.append(q["deq"])
            codes.append(q["codes"])
            wscales.append(q["wscales"])
            if q["t"] is not None:
                ts.append(q["t"].expand(piece.shape[0]))
            row += piece.shape[0]
        deq_w = torch.cat(deq)
        # biases as deepcompressor's state dict holds them (ShiftedLinear: b - W·shift, from the unsmoothed weight)
        b_conv: torch.Tensor | None = None
        if shift_key is not None:
            (cand,) = cands
            shift = torch.tensor([SHIFT], dtype=BF16)
            self.state[shift_key] = shift
            b = torch.zeros(n, dtype=F64) if biases[0] is None else biases[0].to(F64)
            b_conv = (b - w.sum(dim=1) * shift.to(F64)).to(BF16)
            self.state[f"{cand}.bias"] = b_conv
        elif any(b is not None for b in biases):
            for cand, b in zip(cands, biases):
                self.state[f"{cand}.bias"] = b.to(BF16)
            b_conv = torch.cat([b.to(BF16) for b in biases])
        self.branch[f"{block}.{branch_key}"] = {"a.weight": down, "b.weight": up}
        # what convert_to_nunchaku_w4x4y16_linear_state_dict does with them
        fused = out_proj and self.fused
        lora_down = down.to(dtype=F64)
        if not fused:
            lora_down = lora_down.div_(s.to(F64).unsqueeze(0))
        if shift_key is not None:
            bias = b_conv.to(F64)
            col = torch.tensor([SHIFT], dtype=BF16).view(1, 1).expand(lora_down.shape[1], 1).to(F64)
            b_file = bias.add_((up.to(dtype=F64) @ lora_down @ col).view(-1)).to(BF16)
        else:
            b_file = torch.zeros(n, dtype=BF16) if b_conv is None else b_conv
        d_file = lora_down.to(BF16)
        s_file = torch.ones_like(s) if fused else s
        r_eff = deq_w / s_file.to(F64)
        w_eff = r_eff + up.to(F64) @ d_file.to(F64)
        b_eff = b_file.to(F64) + (SHIFT * r_eff.sum(dim=1) if shift_key is not None else 0)
        p = f"{block}.{local}."
        self.parts[p + "qweight"] = torch.cat(codes)
        self.parts[p + "wscales"] = torch.cat(wscales)
        if ts:
            t = torch.cat(ts)
            self.parts[p + ("wcscales" if len(cands) > 1 else "wtscale")] = t if len(cands) > 1 else t[:1]
        self.parts[p + "bias"] = b_file
        self.parts[p + "smooth"] = s_file
        self.parts[p + "smooth_orig"] = s
        self.parts[p + "lora_down"] = d_file
        self.parts[p + "lora_up"] = up
        return w_eff, b_eff

    def awq(self, block: str, local: str, w: torch.Tensor, b: torch.Tensor, splits: int) -> None:
        """FLUX.1 adaLN: TinyChat W4A16 int4 g64 through convert_to_nunchaku_w4x16_adanorm_{zero,single}."""
        name = f"{block}.{local}"
        w = w.to(F64)
        n, k = w.shape
        g = w.view(n, k // 64, 64)
        scale = (g.abs().amax(-1) / 7).clamp_min(2.0**-24).to(BF16)  # (n, k/64)
        c = torch.round(g / scale.to(F64).unsqueeze(-1)).clamp(-7, 7)
        w_in = (c * scale.to(F64).unsqueeze(-1)).view(n, k).to(BF16)
        b_in = b.to(BF16)
        self.state[f"{name}.weight"], self.state[f"{name}.bias"] = w_in, b_in
        self.scale[f"{name}.weight.scale.0"] = scale.view(n, 1, k // 64, 1)
        # convert_to_tinychat_w4x16y16_linear_weight (zero = 7 pre-scaled): q = round((w + 7 s) / s) in float32
        s32 = scale.to(torch.float32).unsqueeze(-1)
        z32 = torch.full_like(scale, 7).to(torch.float32).unsqueeze(-1) * s32
        q = ((w_in.to(torch.float32).view(n, k // 64, 64) + z32) / s32).round_()
        assert q.min() >= 0 and q.max() <= 15
        wzeros = z32.squeeze(-1).to(BF16).neg_()  # stored -bf16(7 s)
        self.expected[f"{name}.weight"] = (q.to(F64) * scale.to(F64).unsqueeze(-1)
                                           + wzeros.to(F64).unsqueeze(-1)).view(n, k)
        # convert_to_nunchaku_w4x16_linear_weight: rows interleaved, +1 (in bf16) on the scale slots 1 and S-2
        delta = [0] * splits
        delta[1] = delta[-2] = 1
        plus = b_in.view(splits, n // splits) + torch.tensor(delta, dtype=BF16).view(splits, 1)
        self.expected[f"{name}.bias"] = (plus.to(F64) - torch.tensor(delta, dtype=F64).view(splits, 1)).view(n)

        def inter(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(splits, n // splits, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

        p = f"{name}."
        self.parts[p + "qweight"] = inter(q.view(n, k).to(torch.uint8))
        self.parts[p + "wscales"] = inter(scale)
        self.parts[p + "wzeros"] = inter(wzeros)
        self.parts[p + "bias"] = inter(plus.view(n))


def _quiet(fn: Callable, *args, **kwargs):
    """deepcompressor prints a line per layer, a tqdm bar per block, and a torch indexing deprecation warning."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn(*args, **kwargs)


@contextlib.contextmanager
def _one_thread():
    """Tiny matrices gain nothing from intra-op threads, and LAPACK's spinning threads make 12 small SVDs take
    seconds on a busy 2-core machine (milliseconds on one thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _random_state(family: str, config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded float32 weights (bf16-representable) for every tensor of the diffusers model, in its order."""
    model = diffusers_skeleton(_model_class(family), config)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.state_dict().items():
        if p.ndim == 2:
            t = (torch.rand(p.shape, generator=gen, dtype=F64) * 2 - 1) / math.sqrt(p.shape[1])
        elif name.endswith(".bias"):
            t = 0.05 * torch.randn(p.shape, generator=gen, dtype=F64)
        else:  # RMSNorm weights
            t = 1 + 0.1 * torch.randn(p.shape, generator=gen, dtype=F64)
        out[name] = t.to(BF16).to(torch.float32)
    return out


def _model_class(family: str):
    from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

    return {"flux1": FluxTransformer2DModel, "flux2": Flux2Transformer2DModel}[family]


def _v_fuse(inp: _Inputs, w: torch.Tensor, b: torch.Tensor | None, s_key: str, k: int):
    """smooth_diffusion_out_proj with fuse: V rows (and V bias) divided by the out-projection's s, in bf16."""
    if not inp.fused:
        return w, b
    s = inp.smooth_vector(s_key, k).to(F64)
    w = (w.to(F64) / s.view(-1, 1)).to(BF16).to(F64)
    return w, (None if b is None else (b.to(F64) / s).to(BF16).to(F64))


def _flux1(orig: dict[str, torch.Tensor], config: dict, inp: _Inputs) -> None:
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    int4 = inp.precision == "int4"
    for key, value in orig.items():
        if not key.startswith(BLOCK_PREFIXES):
            inp.copy(key, value)
    E = inp.expected
    for i in range(config["num_layers"]):
        b = f"transformer_blocks.{i}"

        def o(name: str) -> torch.Tensor:
            return orig[f"{b}.{name}"]

        down, cdown = ("ff.net.2.linear", "ff_context.net.2.linear") if int4 else ("ff.net.2", "ff_context.net.2")
        for key in ("attn.to_q", "attn.add_k_proj", "attn.to_out.0", "ff.net.0.proj", down,
                    "ff_context.net.0.proj", cdown):  # smooth.pt, fixed draw order
            k = o(f"{key.removesuffix('.linear')}.weight").shape[1]
            inp.smooth_vector(f"{b}.{key}", k)
        for nm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            inp.copy(f"{b}.attn.{nm}.weight", o(f"attn.{nm}.weight"))
        inp.awq(b, "norm1.linear", o("norm1.linear.weight"), o("norm1.linear.bias"), 6)
        inp.awq(b, "norm1_context.linear", o("norm1_context.linear.weight"), o("norm1_context.linear.bias"), 6)
        s_out = f"{b}.attn.to_out.0"
        wv, bv = _v_fuse(inp, o("attn.to_v.weight"), o("attn.to_v.bias"), s_out, inner)
        wav, bav = _v_fuse(inp, o("attn.add_v_proj.weight"), o("attn.add_v_proj.bias"), s_out, inner)
        for local, names, v, smooth_key in (("qkv_proj", ("to_q", "to_k", "to_v"), (wv, bv), "attn.to_q"),
                                            ("qkv_proj_context", ("add_q_proj", "add_k_proj", "add_v_proj"),
                                             (wav, bav), "attn.add_k_proj")):
            ws = [o(f"attn.{names[0]}.weight"), o(f"attn.{names[1]}.weight"), v[0]]
            bs = [o(f"attn.{names[0]}.bias"), o(f"attn.{names[1]}.bias"), v[1]]
            w_eff, b_eff = inp.svdq(b, local, [f"{b}.attn.{nm}" for nm in names], ws, bs, smooth_key, smooth_key)
            for j, nm in enumerate(names):
                E[f"{b}.attn.{nm}.weight"] = w_eff[j * inner: (j + 1) * inner]
                E[f"{b}.attn.{nm}.bias"] = b_eff[j * inner: (j + 1) * inner]
        for local, diff, smooth_key, out_proj, shift in (
                ("out_proj", "attn.to_out.0", "attn.to_out.0", True, None),
                ("out_proj_context", "attn.to_add_out", "attn.to_out.0", True, None),
                ("mlp_fc1", "ff.net.0.proj", "ff.net.0.proj", False, None),
                ("mlp_fc2", "ff.net.2", down, False, "ff.net.2.shift" if int4 else None),
                ("mlp_context_fc1", "ff_context.net.0.proj", "ff_context.net.0.proj", False, None),
                ("mlp_context_fc2", "ff_context.net.2", cdown, False, "ff_context.net.2.shift" if int4 else None)):
            cand = f"{b}.{diff}.linear" if shift else f"{b}.{diff}"
            w_eff, b_eff = inp.svdq(b, local, [cand], [o(f"{diff}.weight")], [o(f"{diff}.bias")], smooth_key,
                                    diff + (".linear" if shift else ""), shift and f"{b}.{shift}", out_proj)
            E[f"{b}.{diff}.weight"], E[f"{b}.{diff}.bias"] = w_eff, b_eff
        if inp.fused:
            s = inp.smooth[s_out]
            vs = [(f"{b}.attn.to_v.weight", slice(None)), (f"{b}.attn.add_v_proj.weight", slice(None))]
            inp.fusion += [(f"{b}.attn.to_out.0.weight", slice(None), vs, s),
                           (f"{b}.attn.to_add_out.weight", slice(None), [], s)]
    for i in range(config["num_single_layers"]):
        b = f"single_transformer_blocks.{i}"

        def o(name: str) -> torch.Tensor:
            return orig[f"{b}.{name}"]

        down = "proj_out.linears.1.linear" if int4 else "proj_out.linears.1"
        w_out = o("proj_out.weight")
        inp.smooth_vector(f"{b}.attn.to_q", inner)
        inp.smooth_vector(f"{b}.proj_out.linears.0", inner)
        inp.smooth_vector(f"{b}.{down}", w_out.shape[1] - inner)
        for nm in ("norm_q", "norm_k"):
            inp.copy(f"{b}.attn.{nm}.weight", o(f"attn.{nm}.weight"))
        inp.awq(b, "norm.linear", o("norm.linear.weight"), o("norm.linear.bias"), 3)
        wv, bv = _v_fuse(inp, o("attn.to_v.weight"), o("attn.to_v.bias"), f"{b}.proj_out.linears.0", inner)
        names = ("to_q", "to_k", "to_v")
        w_eff, b_eff = inp.svdq(b, "qkv_proj", [f"{b}.attn.{nm}" for nm in names],
                                [o("attn.to_q.weight"), o("attn.to_k.weight"), wv],
                                [o("attn.to_q.bias"), o("attn.to_k.bias"), bv], "attn.to_q", "attn.to_q")
        for j, nm in enumerate(names):
            E[f"{b}.attn.{nm}.weight"] = w_eff[j * inner: (j + 1) * inner]
            E[f"{b}.attn.{nm}.bias"] = b_eff[j * inner: (j + 1) * inner]
        E[f"{b}.proj_mlp.weight"], E[f"{b}.proj_mlp.bias"] = inp.svdq(
            b, "mlp_fc1", [f"{b}.proj_mlp"], [o("proj_mlp.weight")], [o("proj_mlp.bias")], "attn.to_q", "proj_mlp")
        # ConcatLinear: proj_out.linears.0 (attn columns, no bias) + proj_out.linears.1 (mlp columns, the bias)
        w0, b0 = inp.svdq(b, "out_proj", [f"{b}.proj_out.linears.0"], [w_out[:, :inner]], [None],
                          "proj_out.linears.0", "proj_out.linears.0", out_proj=True)
        w1, b1 = inp.svdq(b, "mlp_fc2", [f"{b}.{down}"], [w_out[:, inner:]], [o("proj_out.bias")], down, down,
                          f"{b}.proj_out.linears.1.shift" if int4 else None)
        E[f"{b}.proj_out.weight"], E[f"{b}.proj_out.bias"] = torch.cat([w0, w1], dim=1), b1 + b0
        if inp.fused:
            inp.fusion.append((f"{b}.proj_out.weight", slice(0, inner), [(f"{b}.attn.to_v.weight", slice(None))],
                               inp.smooth[f"{b}.proj_out.linears.0"]))


def _flux2(orig: dict[str, torch.Tensor], config: dict, inp: _Inputs) -> None:
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(inner * config["mlp_ratio"])
    for key, value in orig.items():
        if not key.startswith(BLOCK_PREFIXES):
            inp.copy(key, value)
    E = inp.expected
    for i in range(config["num_layers"]):
        b = f"transformer_blocks.{i}"

        def o(name: str) -> torch.Tensor:
            return orig[f"{b}.{name}"]

        for key, k in (("attn.to_q", inner), ("attn.add_k_proj", inner), ("attn.to_out.0", inner),
                       ("ff.linear_in", inner), ("ff.linear_out", mlp), ("ff_context.linear_in", inner),
                       ("ff_context.linear_out", mlp)):
            inp.smooth_vector(f"{b}.{key}", k)
        for nm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            inp.copy(f"{b}.attn.{nm}.weight", o(f"attn.{nm}.weight"))
        s_out = f"{b}.attn.to_out.0"
        wv, _ = _v_fuse(inp, o("attn.to_v.weight"), None, s_out, inner)
        wav, _ = _v_fuse(inp, o("attn.add_v_proj.weight"), None, s_out, inner)
        for local, names, v, smooth_key in (("qkv_proj", ("to_q", "to_k", "to_v"), wv, "attn.to_q"),
                                            ("qkv_proj_context", ("add_q_proj", "add_k_proj", "add_v_proj"), wav,
                                             "attn.add_k_proj")):
            ws = [o(f"attn.{names[0]}.weight"), o(f"attn.{names[1]}.weight"), v]
            w_eff, _ = inp.svdq(b, local, [f"{b}.attn.{nm}" for nm in names], ws, [None] * 3, smooth_key,
                                smooth_key)
            for j, nm in enumerate(names):
                E[f"{b}.attn.{nm}.weight"] = w_eff[j * inner: (j + 1) * inner]
        for local, diff, smooth_key, out_proj in (
                ("out_proj", "attn.to_out.0", "attn.to_out.0", True),
                ("out_proj_context", "attn.to_add_out", "attn.to_out.0", True),
                ("mlp_fc1", "ff.linear_in", "ff.linear_in", False),
                ("mlp_fc2", "ff.linear_out", "ff.linear_out", False),
                ("mlp_context_fc1", "ff_context.linear_in", "ff_context.linear_in", False),
                ("mlp_context_fc2", "ff_context.linear_out", "ff_context.linear_out", False)):
            E[f"{b}.{diff}.weight"], _ = inp.svdq(b, local, [f"{b}.{diff}"], [o(f"{diff}.weight")], [None],
                                                  smooth_key, diff, None, out_proj)
        if inp.fused:
            s = inp.smooth[s_out]
            vs = [(f"{b}.attn.to_v.weight", slice(None)), (f"{b}.attn.add_v_proj.weight", slice(None))]
            inp.fusion += [(f"{b}.attn.to_out.0.weight", slice(None), vs, s),
                           (f"{b}.attn.to_add_out.weight", slice(None), [], s)]
    for i in range(config["num_single_layers"]):
        b = f"single_transformer_blocks.{i}"
        w_in = orig[f"{b}.attn.to_qkv_mlp_proj.weight"]  # rows [q; k; v; mlp_in]
        w_out = orig[f"{b}.attn.to_out.weight"]  # columns [attn; mlp]
        for key, k in (("attn.qkv_proj", inner), ("attn.out_proj", inner), ("attn.mlp_fc2", mlp)):
            inp.smooth_vector(f"{b}.{key}", k)
        for nm in ("norm_q", "norm_k"):
            inp.copy(f"{b}.attn.{nm}.weight", orig[f"{b}.attn.{nm}.weight"])
        wv, _ = _v_fuse(inp, w_in[2 * inner: 3 * inner], None, f"{b}.attn.out_proj", inner)
        qkv = torch.cat([w_in[: 2 * inner].to(F64), wv])
        w_qkv, _ = inp.svdq(b, "qkv_proj", [f"{b}.attn.qkv_proj"], [qkv], [None], "attn.qkv_proj", "attn.qkv_proj")
        w_fc1, _ = inp.svdq(b, "mlp_fc1", [f"{b}.attn.mlp_fc1"], [w_in[3 * inner:]], [None], "attn.qkv_proj",
                            "attn.mlp_fc1")
        w_o, _ = inp.svdq(b, "out_proj", [f"{b}.attn.out_proj"], [w_out[:, :inner]], [None], "attn.out_proj",
                          "attn.out_proj", out_proj=True)
        w_fc2, _ = inp.svdq(b, "mlp_fc2", [f"{b}.attn.mlp_fc2"], [w_out[:, inner:]], [None], "attn.mlp_fc2",
                            "attn.mlp_fc2")
        E[f"{b}.attn.to_qkv_mlp_proj.weight"] = torch.cat([w_qkv, w_fc1])
        E[f"{b}.attn.to_out.weight"] = torch.cat([w_o, w_fc2], dim=1)
        if inp.fused:
            inp.fusion.append((f"{b}.attn.to_out.weight", slice(0, inner),
                               [(f"{b}.attn.to_qkv_mlp_proj.weight", slice(2 * inner, 3 * inner))],
                               inp.smooth[f"{b}.attn.out_proj"]))


def _convert(family: str, config: dict, inp: _Inputs) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """deepcompressor's converter on the inputs: (quantized block tensors, unquantized tensors), file names."""
    from deepcompressor.backend.nunchaku.convert import (
        convert_to_nunchaku_flux_state_dicts,
        convert_to_nunchaku_transformer_block_state_dict,
        update_state_dict,
    )

    float_point = inp.precision == "nvfp4"
    if family == "flux1":
        return _quiet(convert_to_nunchaku_flux_state_dicts, inp.state, inp.scale, inp.smooth, inp.branch,
                      float_point=float_point)
    blocks: dict[str, torch.Tensor] = {}
    for kind, n, maps in (("transformer_blocks", config["num_layers"], FLUX2_DOUBLE_MAPS),
                          ("single_transformer_blocks", config["num_single_layers"], FLUX2_SINGLE_MAPS)):
        for i in range(n):
            block = f"{kind}.{i}"
            converted = _quiet(convert_to_nunchaku_transformer_block_state_dict, state_dict=inp.state,
                               scale_dict=inp.scale, smooth_dict=inp.smooth, branch_dict=inp.branch,
                               block_name=block, float_point=float_point, **maps)
            update_state_dict(blocks, converted, prefix=block)
    other = {k: v for k, v in inp.state.items() if not k.startswith(BLOCK_PREFIXES)}
    return blocks, other


def flux2_module_key(key: str) -> str:
    """A FLUX.2 converter-named key (qkv_proj.lora_down) in tonera / nunchaku_lite module names
    (attn.to_qkv.proj_down)."""
    if not key.startswith(BLOCK_PREFIXES):
        return key
    kind, idx, rest = key.split(".", 2)
    local, part = rest.split(".", 1)
    table = FLUX2_DOUBLE_MODULES if kind == "transformer_blocks" else FLUX2_SINGLE_MODULES
    return f"{kind}.{idx}.{table[local]}.{MODULE_PARTS.get(part, part)}"


def quantization_config(precision: str, rank: int) -> dict:
    """The `quantization_config` metadata (nunchaku merge_safetensors.py shape, plus the rank tonera reads)."""
    if precision == "int4":
        q = {"dtype": "int4", "scale_dtype": None, "group_size": 64}
        return {"method": "svdquant", "weight": q, "activation": dict(q), "rank": rank}
    return {"method": "svdquant",
            "weight": {"dtype": "fp4_e2m1_all", "scale_dtype": [None, "fp8_e4m3_nan"], "group_size": 16},
            "activation": {"dtype": "fp4_e2m1_all", "scale_dtype": "fp8_e4m3_nan", "group_size": 16}, "rank": rank}


def _file_metadata(family: str, config: dict, precision: str, rank: int) -> dict[str, str]:
    meta = {"config": json.dumps(config)}
    if family == "flux1":
        meta["comfy_config"] = "{}"
    meta["model_class"] = MODEL_CLASS[family]
    meta["quantization_config"] = json.dumps(quantization_config(precision, rank))
    return meta


def _full_config(family: str, base: dict | None = None) -> dict:
    import diffusers

    config = dict(base or (FLUX1_CONFIG if family == "flux1" else FLUX2_CONFIG))
    config["_diffusers_version"] = diffusers.__version__
    return config


_TAGS = {torch.bfloat16: "BF16", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32",
         torch.uint8: "U8", torch.int32: "I32"}
_SIZES = {"BF16": 2, "I8": 1, "F8_E4M3": 1, "F32": 4, "U8": 1, "I32": 4}


class _StreamWriter:
    """A safetensors file whose header is written first from a plan, then tensors appended in plan order."""

    def __init__(self, path: Path, plan: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None):
        header: dict[str, object] = {}
        offset = 0
        for key, tag, shape in plan:
            nbytes = math.prod(shape) * _SIZES[tag]
            header[key] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        if metadata:
            header["__metadata__"] = metadata
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        self.plan = list(plan)
        self.next = 0
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(blob)) + blob)

    def write(self, key: str, pieces: torch.Tensor | Iterable[torch.Tensor]) -> None:
        want, tag, shape = self.plan[self.next]
        assert key == want, f"writing {key} where the plan has {want}"
        self.next += 1
        written = 0
        for t in [pieces] if isinstance(pieces, torch.Tensor) else pieces:
            assert _TAGS[t.dtype] == tag, f"{key}: {t.dtype} is not {tag}"
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            self.f.write(memoryview(raw))
            written += raw.nbytes
        assert written == math.prod(shape) * _SIZES[tag], f"{key}: wrote {written} bytes for {shape} {tag}"

    def close(self) -> None:
        self.f.close()
        assert self.next == len(self.plan), f"{len(self.plan) - self.next} planned tensors were not written"


def _save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> Path:
    """safetensors with keys sorted and metadata in insertion order: the same bytes for the same seed
    (safetensors' own save_file writes the metadata map in an arbitrary order)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    writer = _StreamWriter(path, [(k, _TAGS[tensors[k].dtype], tuple(tensors[k].shape)) for k in keys], metadata)
    try:
        for k in keys:
            writer.write(k, tensors[k])
    finally:
        writer.close()
    return path


def write_svdq_file(out_dir: Path, family: str = "flux2", precision: str = "int4", *, rank: int = 16,
                    spelling: str = "module", container: str = "single", smooth_fused: bool = False,
                    seed: int = 0, metadata: bool = True) -> SvdqFixture:
    """Write a tiny SVDQuant checkpoint made by deepcompressor's converter, and return it with its oracle.

    family "flux1": deepcompressor names (qkv_proj, lora_down, smooth, ...) as real FLUX.1 files carry them, single
    merged file or the legacy split folder (container "split"); `spelling` does not apply (real FLUX.1 files have
    one spelling). family "flux2": single file, `spelling` "module" (tonera / nunchaku_lite module names:
    attn.to_qkv.proj_down, ...) or "alias" (the converter's names under the block prefix).
    """
    if family not in ("flux1", "flux2"):
        raise ValueError(f"family must be flux1 or flux2, not {family!r}")
    if precision not in ("int4", "nvfp4"):
        raise ValueError(f"precision must be int4 or nvfp4, not {precision!r}")
    if spelling not in ("module", "alias"):
        raise ValueError(f"spelling must be module or alias, not {spelling!r}")
    if container not in ("single", "split") or (container == "split" and family != "flux1"):
        raise ValueError(f"container {container!r}: 'split' exists for flux1 only, 'single' for both")
    if rank < 1:
        raise ValueError("rank must be positive")
    out_dir = Path(out_dir)
    config = _full_config(family)
    with _one_thread():
        original = _random_state(family, config, seed)
        inp = _Inputs(precision, rank, smooth_fused, torch.Generator().manual_seed(seed + 1_000_003))
        (_flux1 if family == "flux1" else _flux2)(original, config, inp)
        blocks, other = _convert(family, config, inp)
    parts = dict(inp.parts)
    if family == "flux2" and spelling == "module":
        blocks = {flux2_module_key(k): v for k, v in blocks.items()}
        parts = {flux2_module_key(k): v for k, v in parts.items()}
    missing = set(parts) - set(blocks)
    assert not missing, f"the oracle names tensors the converter did not write: {sorted(missing)[:5]}"

    tag = "int4" if precision == "int4" else "fp4"
    stem = f"svdq-{tag}_r{rank}-" + ("flux.1-tiny" if family == "flux1" else "flux.2-klein-tiny")
    meta = _file_metadata(family, config, precision, rank) if metadata and container == "single" else {}
    if container == "split":
        folder = out_dir / stem
        files = [_save(folder / "transformer_blocks.safetensors", blocks, None),
                 _save(folder / "unquantized_layers.safetensors", other, None)]
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        path = folder
    else:
        path = _save(out_dir / f"{stem}.safetensors", {**other, **blocks}, meta)
        files = [path]

    shapes = {k: tuple(v.shape) for k, v in diffusers_skeleton(_model_class(family), config).state_dict().items()}
    assert set(inp.expected) == set(shapes), sorted(set(inp.expected) ^ set(shapes))[:5]
    expected = {k: inp.expected[k].to(torch.float32) for k in shapes}
    assert all(tuple(expected[k].shape) == shapes[k] for k in shapes)
    return SvdqFixture(files=files, path=path, family=family, precision=precision, rank=rank, config=config,
                       expected=expected, original=original, metadata=meta, parts=parts, fusion=inp.fusion)


# ----------------------------------------------------------------------------------------------------------------
# corrupting a file


def _header(path: Path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def corrupt_tile(path: Path, key: str) -> None:
    """Flip every bit of the first 128x64 tile (4096 bytes) of a stored qweight, in place; the header is kept."""
    start, header = _header(Path(path))
    if key not in header or not key.endswith("qweight"):
        raise KeyError(f"{key!r} is not a qweight stored in {path}")
    lo, hi = header[key]["data_offsets"]
    n = min(128 * 64 // 2, hi - lo)
    with open(path, "r+b") as f:
        f.seek(start + lo)
        data = bytearray(f.read(n))
        for i in range(n):
            data[i] ^= 0xFF
        f.seek(start + lo)
        f.write(data)


# ----------------------------------------------------------------------------------------------------------------
# real-size (klein-9B shaped) file, streamed layer by layer

def _svdq_plan(name: str, n: int, k: int, rank: int, precision: str, pieces: int) -> list[tuple[str, str, tuple]]:
    """The tensors deepcompressor's per-layer converter writes for an (n, k) layer, in its order, module names."""
    r = -(-rank // 16) * 16
    plan = [(f"{name}.qweight", "I8", (n, k // 2))]
    if precision == "int4":
        plan.append((f"{name}.wscales", "BF16", (k // 64, n)))
    else:
        plan.append((f"{name}.wcscales", "BF16", (n,)) if pieces > 1 else (f"{name}.wtscale", "BF16", (1,)))
        plan.append((f"{name}.wscales", "F8_E4M3", (k // 16, n)))
    plan += [(f"{name}.bias", "BF16", (n,)), (f"{name}.smooth_factor_orig", "BF16", (k,)),
             (f"{name}.smooth_factor", "BF16", (k,)), (f"{name}.proj_down", "BF16", (k, r)),
             (f"{name}.proj_up", "BF16", (n, r))]
    return plan


_FROM_CONVERTER = {"qweight": "qweight", "wscales": "wscales", "wtscale": "wtscale", "wcscales": "wcscales",
                   "bias": "bias", "smooth_factor_orig": "smooth_orig", "smooth_factor": "smooth",
                   "proj_down": "lora_down", "proj_up": "lora_up"}
_PER_TENSOR = ("smooth_orig", "smooth", "lora_down", "wtscale")  # the same in every row chunk


def _random_svdq_layer(n: int, k: int, rank: int, precision: str, pieces: int, gen: torch.Generator,
                       chunk_rows: int) -> dict[str, list[torch.Tensor]]:
    """Random grid codes, scales, s and a random low-rank U, D (no SVD), packed by the converter in row chunks.

    Every packed tensor deepcompressor writes is ordered by 128-row tile first (qweight, wscales, the vectors,
    lora_up), so converting row chunks (multiples of 128) and concatenating gives the bytes of the whole layer;
    smooth, smooth_orig, lora_down and wtscale do not depend on the rows and are taken once.
    """
    from deepcompressor.backend.nunchaku.convert import convert_to_nunchaku_w4x4y16_linear_state_dict

    assert n % 128 == 0 and k % 128 == 0 and chunk_rows % 128 == 0 and (n // pieces) % 128 == 0
    s = (0.5 + torch.rand(k, generator=gen)).to(BF16)
    down = (torch.randn(rank, k, generator=gen) / math.sqrt(k)).to(BF16)
    piece_t = [torch.tensor([2.0 ** -14 * (1 + torch.rand(1, generator=gen).item())]).to(BF16) for _ in range(pieces)]
    out: dict[str, list[torch.Tensor]] = {}
    per_piece = n // pieces
    for start in range(0, n, chunk_rows):
        rows = min(chunk_rows, n - start)
        up = (0.02 * torch.randn(rows, rank, generator=gen)).to(BF16)
        if precision == "int4":
            codes = torch.randint(-7, 8, (rows, k), generator=gen, dtype=torch.int8)
            scale = (1e-3 * (1 + 4 * torch.rand(rows, 1, k // 64, 1, generator=gen))).to(BF16)
            weight = (codes.to(torch.float32).view(rows, 1, k // 64, 64) * scale.to(torch.float32)).view(rows, k)
            kwargs = {"scale": scale, "subscale": None}
        else:
            idx = torch.randint(0, 16, (rows, k), generator=gen)
            sub = (2.0 ** (torch.randint(-6, 8, (rows, 1, k // 16, 1), generator=gen).to(torch.float32))
                   * (1 + torch.randint(0, 8, (rows, 1, k // 16, 1), generator=gen) / 8)).to(BF16)
            which = torch.div(torch.arange(start, start + rows), per_piece, rounding_mode="floor")
            t = torch.cat(piece_t)[which].view(rows, 1, 1, 1) if pieces > 1 else piece_t[0].view(1, 1, 1, 1)
            weight = (E2M1.to(torch.float32)[idx].view(rows, 1, k // 16, 16) * sub.to(torch.float32)
                      * t.to(torch.float32).view(-1, 1, 1, 1)).view(rows, k)
            kwargs = {"scale": t, "subscale": sub}
        packed = _quiet(convert_to_nunchaku_w4x4y16_linear_state_dict, weight=weight.to(BF16), bias=None,
                        smooth=s, lora=(down, up), shift=None, smooth_fused=False,
                        float_point=precision == "nvfp4", **kwargs)
        for part, tensor in packed.items():
            if part in _PER_TENSOR and part in out:
                continue
            out.setdefault(part, []).append(tensor)
    return out


def _write_streamed(path: Path, config: dict, precision: str, rank: int, seed: int, chunk_rows: int) -> Path:
    """A FLUX.2 SVDQuant file (module spelling, metadata) at `config`'s shapes, one layer in memory at a time."""
    config = _full_config("flux2", config)
    inner = config["num_attention_heads"] * config["attention_head_dim"]
    mlp = int(inner * config["mlp_ratio"])
    shapes = {k: tuple(v.shape) for k, v in diffusers_skeleton(_model_class("flux2"), config).state_dict().items()}
    # (name, n, k, pieces) per quantized layer, module names
    layers: list[tuple[str, int, int, int]] = []
    for i in range(config["num_layers"]):
        b = f"transformer_blocks.{i}"
        layers += [(f"{b}.attn.to_qkv", 3 * inner, inner, 3), (f"{b}.attn.to_added_qkv", 3 * inner, inner, 3),
                   (f"{b}.attn.to_out.0", inner, inner, 1), (f"{b}.attn.to_add_out", inner, inner, 1),
                   (f"{b}.ff.linear_in", 2 * mlp, inner, 1), (f"{b}.ff.linear_out", inner, mlp, 1),
                   (f"{b}.ff_context.linear_in", 2 * mlp, inner, 1), (f"{b}.ff_context.linear_out", inner, mlp, 1)]
    for i in range(config["num_single_layers"]):
        b = f"single_transformer_blocks.{i}"
        layers += [(f"{b}.attn.qkv_proj", 3 * inner, inner, 1), (f"{b}.attn.mlp_fc1", 2 * mlp, inner, 1),
                   (f"{b}.attn.out_proj", inner, inner, 1), (f"{b}.attn.mlp_fc2", inner, mlp, 1)]
    plain = [k for k in shapes if not k.startswith(BLOCK_PREFIXES) or ".norm_" in k]
    plan = [(k, "BF16", shapes[k]) for k in plain]
    for name, n, k, pieces in layers:
        plan += _svdq_plan(name, n, k, rank, precision, pieces)
    writer = _StreamWriter(path, plan, _file_metadata("flux2", config, precision, rank))
    gen = torch.Generator().manual_seed(seed)
    try:
        for key in plain:
            shape = shapes[key]

            def rows(shape=shape, key=key) -> Iterable[torch.Tensor]:
                if len(shape) == 1:
                    yield (1 + 0.1 * torch.randn(shape, generator=gen)).to(BF16)
                    return
                for start in range(0, shape[0], 4096):
                    n = min(4096, shape[0] - start)
                    yield (torch.randn(n, shape[1], generator=gen) / math.sqrt(shape[1])).to(BF16)

            writer.write(key, rows())
        for name, n, k, pieces in layers:
            packed = _random_svdq_layer(n, k, rank, precision, pieces, gen, chunk_rows)
            for key, _, _ in _svdq_plan(name, n, k, rank, precision, pieces):
                writer.write(key, packed.pop(_FROM_CONVERTER[key.rsplit(".", 1)[1]]))
            assert not packed, f"{name}: the converter wrote {sorted(packed)} beyond the plan"
    finally:
        writer.close()
    return path


def write_klein9b_shaped(path: Path, precision: str = "int4", rank: int = 32, blocks: tuple[int, int] | None = None,
                         *, seed: int = 0, chunk_rows: int = 4096) -> Path:
    """A klein-9B-shaped SVDQuant file for benchmarks (random weights, deepcompressor-packed, streamed).

    inner 4096 (32 heads x 128), mlp_hidden 12288, joint_attention_dim 12288, in_channels 128, 8 double and 24
    single blocks (`blocks=(double, single)` cuts the counts). Module spelling, zero biases, metadata as the tiny
    FLUX.2 fixture. `path`: the .safetensors to write, or a folder to write the default name into. Only one
    layer's packed tensors and one row chunk of the converter's float32 work are in memory at a time.
    """
    if precision not in ("int4", "nvfp4"):
        raise ValueError(f"precision must be int4 or nvfp4, not {precision!r}")
    config = dict(KLEIN9B_CONFIG)
    if blocks is not None:
        config["num_layers"], config["num_single_layers"] = blocks
    path = Path(path)
    if path.is_dir():
        tag = "int4" if precision == "int4" else "fp4"
        path = path / f"svdq-{tag}_r{rank}-flux.2-klein-9b-shaped.safetensors"
    path.parent.mkdir(parents=True, exist_ok=True)
    return _write_streamed(path, config, precision, rank, seed, chunk_rows)
