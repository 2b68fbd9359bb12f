"""Independent reference of the FLUX.1 transformer forward pass (dev / schnell), in BFL (original) naming.

FLUX.1 differs from FLUX.2 (flux2-checkpoints.md section 7): every linear has a bias; modulation is per block
(`img_mod`, `txt_mod`, single `modulation`) instead of shared; a pooled text vector enters through `vector_in`;
the MLP is Linear -> GELU(tanh) -> Linear with M = 4 D; `linear1` rows are [q | k | v | mlp] (3 D + M);
RoPE has 3 axes (16, 56, 56) with theta 10000. The shared math (timestep features, LayerNorm, RMSNorm, RoPE
rotation of adjacent pairs, attention over [txt ; img]) is section 6's and comes from `flux2_bfl`.
Imports torch only, never diffusers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .flux2_bfl import QKNorm, apply_rope, attention, modulate, rope_angles, split_heads, time_features


@dataclass(frozen=True)
class Flux1Params:
    in_channels: int = 64
    vec_in_dim: int = 768  # pooled CLIP text vector
    context_dim: int = 4096
    hidden: int = 3072
    heads: int = 24
    mlp_ratio: float = 4.0
    depth: int = 19
    depth_single: int = 38
    axes: tuple[int, ...] = (16, 56, 56)
    theta: float = 10000.0
    guidance: bool = True  # dev: True, schnell: False

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mlp_hidden(self) -> int:
        return int(self.hidden * self.mlp_ratio)


class Embedder(nn.Module):
    """`time_in` / `vector_in` / `guidance_in`: out_layer(silu(in_layer(x))), with biases."""

    def __init__(self, dim_in: int, dim: int):
        super().__init__()
        self.in_layer = nn.Linear(dim_in, dim)
        self.out_layer = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_layer(F.silu(self.in_layer(x)))


class Modulation(nn.Module):
    """Per-block `lin(silu(vec))` chunked into (shift, scale, gate) triples."""

    def __init__(self, dim: int, triples: int):
        super().__init__()
        self.triples = triples
        self.lin = nn.Linear(dim, 3 * triples * dim)

    def forward(self, vec: torch.Tensor) -> list[torch.Tensor]:
        return list(self.lin(F.silu(vec))[:, None, :].chunk(3 * self.triples, dim=-1))


class StreamAttention(nn.Module):
    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm = QKNorm(head_dim)
        self.proj = nn.Linear(dim, dim)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class DoubleBlock(nn.Module):
    def __init__(self, p: Flux1Params):
        super().__init__()
        self.heads = p.heads
        for stream in ("img", "txt"):
            setattr(self, f"{stream}_mod", Modulation(p.hidden, 2))
            setattr(self, f"{stream}_attn", StreamAttention(p.hidden, p.head_dim))
            setattr(self, f"{stream}_mlp", nn.Sequential(nn.Linear(p.hidden, p.mlp_hidden),
                                                         nn.GELU(approximate="tanh"),
                                                         nn.Linear(p.mlp_hidden, p.hidden)))

    def _qkv(self, attn: StreamAttention, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v = (split_heads(part, self.heads) for part in attn.qkv(h).chunk(3, dim=-1))
        return attn.norm.query_norm(q).to(v.dtype), attn.norm.key_norm(k).to(v.dtype), v

    def forward(self, img, txt, vec, angles):
        m_img, m_txt = self.img_mod(vec), self.txt_mod(vec)
        q_i, k_i, v_i = self._qkv(self.img_attn, modulate(img, m_img[0], m_img[1]))
        q_t, k_t, v_t = self._qkv(self.txt_attn, modulate(txt, m_txt[0], m_txt[1]))
        q = apply_rope(torch.cat([q_t, q_i], dim=2), angles)
        k = apply_rope(torch.cat([k_t, k_i], dim=2), angles)
        a = attention(q, k, torch.cat([v_t, v_i], dim=2))
        n_txt = txt.shape[1]
        img = img + m_img[2] * self.img_attn.proj(a[:, n_txt:])
        img = img + m_img[5] * self.img_mlp(modulate(img, m_img[3], m_img[4]))
        txt = txt + m_txt[2] * self.txt_attn.proj(a[:, :n_txt])
        txt = txt + m_txt[5] * self.txt_mlp(modulate(txt, m_txt[3], m_txt[4]))
        return img, txt


class SingleBlock(nn.Module):
    def __init__(self, p: Flux1Params):
        super().__init__()
        self.p = p
        self.linear1 = nn.Linear(p.hidden, 3 * p.hidden + p.mlp_hidden)  # rows [q | k | v | mlp]
        self.linear2 = nn.Linear(p.hidden + p.mlp_hidden, p.hidden)  # columns [attention | mlp]
        self.norm = QKNorm(p.head_dim)
        self.modulation = Modulation(p.hidden, 1)

    def forward(self, x, vec, angles):
        p = self.p
        shift, scale, gate = self.modulation(vec)
        q, k, v, mlp = self.linear1(modulate(x, shift, scale)).split([p.hidden] * 3 + [p.mlp_hidden], dim=-1)
        q, k, v = (split_heads(t, p.heads) for t in (q, k, v))
        q = self.norm.query_norm(q).to(v.dtype)
        k = self.norm.key_norm(k).to(v.dtype)
        a = attention(apply_rope(q, angles), apply_rope(k, angles), v)
        return x + gate * self.linear2(torch.cat([a, gelu_tanh(mlp)], dim=-1))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out: int):
        super().__init__()
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))  # rows (shift, scale)

    def forward(self, x: torch.Tensor, vec: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(vec)[:, None, :].chunk(2, dim=-1)
        return self.linear(modulate(x, shift, scale))


class Flux1Reference(nn.Module):
    def __init__(self, p: Flux1Params):
        super().__init__()
        assert sum(p.axes) == p.head_dim, "RoPE axes must cover the head dim"
        self.p = p
        self.img_in = nn.Linear(p.in_channels, p.hidden)
        self.time_in = Embedder(256, p.hidden)
        self.vector_in = Embedder(p.vec_in_dim, p.hidden)
        if p.guidance:
            self.guidance_in = Embedder(256, p.hidden)
        self.txt_in = nn.Linear(p.context_dim, p.hidden)
        self.double_blocks = nn.ModuleList(DoubleBlock(p) for _ in range(p.depth))
        self.single_blocks = nn.ModuleList(SingleBlock(p) for _ in range(p.depth_single))
        self.final_layer = FinalLayer(p.hidden, p.in_channels)

    def forward(self, x: torch.Tensor, x_ids: torch.Tensor, ctx: torch.Tensor, ctx_ids: torch.Tensor,
                y: torch.Tensor, timesteps: torch.Tensor, guidance: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L_img, in]; ids [B, L, 3]; ctx [B, L_txt, C]; y [B, vec_in_dim] pooled text; timesteps [B]."""
        vec = self.time_in(time_features(timesteps).to(x.dtype))
        if self.p.guidance:
            if guidance is None:
                raise ValueError("FLUX.1-dev has a guidance embedder; pass guidance")
            vec = vec + self.guidance_in(time_features(guidance).to(x.dtype))
        vec = vec + self.vector_in(y)
        img, txt = self.img_in(x), self.txt_in(ctx)
        angles = rope_angles(torch.cat([ctx_ids, x_ids], dim=1), self.p.axes, self.p.theta)
        for block in self.double_blocks:
            img, txt = block(img, txt, vec, angles)
        joint = torch.cat([txt, img], dim=1)
        for block in self.single_blocks:
            joint = block(joint, vec, angles)
        return self.final_layer(joint[:, txt.shape[1]:], vec)


def image_ids(batch: int, height: int, width: int) -> torch.Tensor:
    """(0, h, w) on the packed grid, row-major -> [B, h*w, 3]."""
    h, w = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = torch.stack([torch.zeros_like(h), h, w], dim=-1).reshape(-1, 3)
    return ids[None].expand(batch, -1, -1).float()


def text_ids(batch: int, length: int) -> torch.Tensor:
    """FLUX.1 text tokens all sit at position (0, 0, 0)."""
    return torch.zeros(batch, length, 3)
