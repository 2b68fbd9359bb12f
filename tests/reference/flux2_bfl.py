"""Independent reference of the FLUX.2 transformer forward pass, in Black Forest Labs (original) naming.

Written from the math in flux2-checkpoints.md section 6 (and the fused layouts of section 5). It imports torch
only, never diffusers, so it can judge whether converted weights loaded into `Flux2Transformer2DModel` compute
the same function. Parameter names are the BFL checkpoint keys: `state_dict()` of `Flux2Reference` is an original
checkpoint.

Notation as in the document: D hidden, d head dim, H = D / d heads, M MLP hidden (mlp_ratio * D), C text width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Flux2Params:
    in_channels: int = 128
    context_dim: int = 15360  # C
    hidden: int = 6144  # D
    heads: int = 48
    mlp_ratio: float = 3.0
    depth: int = 8  # double-stream blocks
    depth_single: int = 48  # single-stream blocks
    axes: tuple[int, ...] = (32, 32, 32, 32)  # RoPE widths of (t, h, w, l); sum = head dim
    theta: float = 2000.0
    guidance: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)


EPS = 1e-6


def time_features(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    """Item 2: t' = 1000 t; f_i = exp(-ln(10000) i / (dim/2)); [cos(t' f), sin(t' f)], cosine half first."""
    half = dim // 2
    f = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angle = (1000.0 * t.float())[:, None] * f[None, :]
    return torch.cat([torch.cos(angle), torch.sin(angle)], dim=-1)


def plain_layer_norm(x: torch.Tensor) -> torch.Tensor:
    """LayerNorm over the last dim without affine parameters, eps 1e-6."""
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + EPS)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (1 + scale) * plain_layer_norm(x) + shift


def rope_angles(ids: torch.Tensor, axes: tuple[int, ...], theta: float) -> torch.Tensor:
    """Item 6: angle[..., pair] for every adjacent pair of head-dim elements; axis a covers its own slice.

    ids [B, L, n_axes] -> angles [B, L, d/2] (float64). For axis width w and pair j: omega_j = theta^(-2j/w).
    """
    parts = []
    for a, width in enumerate(axes):
        j = torch.arange(width // 2, dtype=torch.float64)
        omega = theta ** (-2.0 * j / width)
        parts.append(ids[..., a].to(torch.float64)[..., None] * omega)
    return torch.cat(parts, dim=-1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x_2j, x_2j+1) by the angle of pair j, in float32; x is [B, H, L, d]."""
    cos = torch.cos(angles).float()[:, None]  # [B, 1, L, d/2]
    sin = torch.sin(angles).float()[:, None]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack([cos * even - sin * odd, sin * even + cos * odd], dim=-1)
    return out.reshape(x.shape).to(x.dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Item 8: softmax(q k^T / sqrt(d)) v per head; [B, H, L, d] in, heads merged head-major to [B, L, H*d] out."""
    weights = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1]), dim=-1)
    out = weights @ v
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, H*d] (head-major columns) -> [B, H, L, d]."""
    b, n, width = x.shape
    return x.reshape(b, n, heads, width // heads).transpose(1, 2)


class RMSNorm(nn.Module):
    """Item 7: y = x / sqrt(mean(x^2) + 1e-6) in float32, cast back, times `scale`."""

    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf / torch.sqrt(xf.pow(2).mean(dim=-1, keepdim=True) + EPS)
        return y.to(x.dtype) * self.scale


class QKNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)


class Embedder(nn.Module):
    """`time_in` / `guidance_in`: out_layer(silu(in_layer(x)))."""

    def __init__(self, dim_in: int, dim: int):
        super().__init__()
        self.in_layer = nn.Linear(dim_in, dim, bias=False)
        self.out_layer = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class SharedModulation(nn.Module):
    """Item 3: `lin(silu(vec))` chunked into triples of (shift, scale, gate)."""

    def __init__(self, dim: int, triples: int):
        super().__init__()
        self.triples = triples
        self.lin = nn.Linear(dim, 3 * triples * dim, bias=False)

    def forward(self, vec: torch.Tensor) -> list[torch.Tensor]:
        return list(self.lin(F.silu(vec))[:, None, :].chunk(3 * self.triples, dim=-1))


class StreamAttention(nn.Module):
    """One stream's attention weights: fused qkv rows [q | k | v], QK norm, output projection."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.norm = QKNorm(head_dim)
        self.proj = nn.Linear(dim, dim, bias=False)


class GateSlot(nn.Module):
    """Placeholder at index 1 of the MLP Sequential (the SwiGLU activation has no weights)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class DoubleBlock(nn.Module):
    def __init__(self, p: Flux2Params):
        super().__init__()
        self.heads = p.heads
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_attn", StreamAttention(p.hidden, p.head_dim))
            # rows of mlp.0 are [gate (M) | up (M)]
            setattr(self, f"{stream}_mlp", nn.Sequential(nn.Linear(p.hidden, 2 * p.mlp_hidden, bias=False),
                                                         GateSlot(), nn.Linear(p.mlp_hidden, p.hidden, bias=False)))

    def _qkv(self, attn: StreamAttention, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = (split_heads(part, self.heads) for part in attn.qkv(h).chunk(3, dim=-1))
        q = attn.norm.query_norm(q)
        k = attn.norm.key_norm(k)
        return q.to(v.dtype), k.to(v.dtype), v

    def forward(self, img, txt, m_img, m_txt, angles):
        q_i, k_i, v_i = self._qkv(self.img_attn, modulate(img, m_img[0], m_img[1]))
        q_t, k_t, v_t = self._qkv(self.txt_attn, modulate(txt, m_txt[0], m_txt[1]))
        # joint attention over [txt ; img]
        q = apply_rope(torch.cat([q_t, q_i], dim=2), angles)
        k = apply_rope(torch.cat([k_t, k_i], dim=2), angles)
        a = attention(q, k, torch.cat([v_t, v_i], dim=2))
        n_txt = txt.shape[1]
        a_txt, a_img = a[:, :n_txt], a[:, n_txt:]
        img = img + m_img[2] * self.img_attn.proj(a_img)
        img = img + m_img[5] * self.img_mlp(modulate(img, m_img[3], m_img[4]))
        txt = txt + m_txt[2] * self.txt_attn.proj(a_txt)
        txt = txt + m_txt[5] * self.txt_mlp(modulate(txt, m_txt[3], m_txt[4]))
        return img, txt


class SingleBlock(nn.Module):
    def __init__(self, p: Flux2Params):
        super().__init__()
        self.p = p
        # rows [q (D) | k (D) | v (D) | gate (M) | up (M)]; columns of linear2 [attention (D) | mlp (M)]
        self.linear1 = nn.Linear(p.hidden, 3 * p.hidden + 2 * p.mlp_hidden, bias=False)
        self.linear2 = nn.Linear(p.hidden + p.mlp_hidden, p.hidden, bias=False)
        self.norm = QKNorm(p.head_dim)

    def forward(self, x, m_s, angles):
        p = self.p
        h = modulate(x, m_s[0], m_s[1])
        q, k, v, gate, up = self.linear1(h).split([p.hidden] * 3 + [p.mlp_hidden] * 2, dim=-1)
        q, k, v = (split_heads(t, p.heads) for t in (q, k, v))
        q = self.norm.query_norm(q).to(v.dtype)
        k = self.norm.key_norm(k).to(v.dtype)
        a = attention(apply_rope(q, angles), apply_rope(k, angles), v)
        out = self.linear2(torch.cat([a, F.silu(gate) * up], dim=-1))
        return x + m_s[2] * out


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out: int):
        super().__init__()
        # rows of adaLN_modulation.1 are (shift, scale)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim, bias=False))
        self.linear = nn.Linear(dim, out, bias=False)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec)[:, None, :].chunk(2, dim=-1)
        return self.linear(modulate(x, shift, scale))


class Flux2Reference(nn.Module):
    def __init__(self, p: Flux2Params):
        super().__init__()
        assert sum(p.axes) == p.head_dim, "RoPE axes must cover the head dim"
        self.p = p
        self.img_in = nn.Linear(p.in_channels, p.hidden, bias=False)
        self.time_in = Embedder(256, p.hidden)
        if p.guidance:
            self.guidance_in = Embedder(256, p.hidden)
        self.txt_in = nn.Linear(p.context_dim, p.hidden, bias=False)
        self.double_blocks = nn.ModuleList(DoubleBlock(p) for _ in range(p.depth))
        self.single_blocks = nn.ModuleList(SingleBlock(p) for _ in range(p.depth_single))
        self.double_stream_modulation_img = SharedModulation(p.hidden, 2)
        self.double_stream_modulation_txt = SharedModulation(p.hidden, 2)
        self.single_stream_modulation = SharedModulation(p.hidden, 1)
        self.final_layer = FinalLayer(p.hidden, p.in_channels)

    def forward(self, x: torch.Tensor, x_ids: torch.Tensor, ctx: torch.Tensor, ctx_ids: torch.Tensor,
                timesteps: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L_img, in]; x_ids [B, L_img, 4]; ctx [B, L_txt, C]; ctx_ids [B, L_txt, 4]; timesteps [B] in [0, 1]."""
        vec = self.time_in(time_features(timesteps).to(x.dtype))
        if self.p.guidance:
            if guidance is None:
                raise ValueError("this model has a guidance embedder; pass guidance")
            vec = vec + self.guidance_in(time_features(guidance).to(x.dtype))
        m_img = self.double_stream_modulation_img(vec)
        m_txt = self.double_stream_modulation_txt(vec)
        m_s = self.single_stream_modulation(vec)
        img, txt = self.img_in(x), self.txt_in(ctx)
        angles = rope_angles(torch.cat([ctx_ids, x_ids], dim=1), self.p.axes, self.p.theta)
        for block in self.double_blocks:
            img, txt = block(img, txt, m_img, m_txt, angles)
        joint = torch.cat([txt, img], dim=1)
        for block in self.single_blocks:
            joint = block(joint, m_s, angles)
        return self.final_layer(joint[:, txt.shape[1]:], vec)


def image_ids(batch: int, height: int, width: int, t: int = 0) -> torch.Tensor:
    """Item 5: (t, h, w, 0) on the packed grid, row-major (h outer, w inner) -> [B, h*w, 4]."""
    h, w = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.stack([torch.full_like(h, t), h, w, torch.zeros_like(h)], dim=-1).reshape(-1, 4)
    return ids[None].expand(batch, -1, -1).float()


def text_ids(batch: int, length: int) -> torch.Tensor:
    """Item 5: (0, 0, 0, l) for token l -> [B, L, 4]."""
    ids = torch.zeros(length, 4)
    ids[:, 3] = torch.arange(length)
    return ids[None].expand(batch, -1, -1)
