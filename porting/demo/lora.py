"""A tiny LoRA made for a tiny converted transformer: what `port demo --lora` inspects, merges and validates.

The LoRA is in diffusers (PEFT) naming, `transformer.MODULE.lora_A.weight` / `lora_B.weight` with no alpha (scale 1),
the form most trainers publish for FLUX.2, and targets every attention projection of the transformer. Each module's
delta B @ A is scaled to REL_NORM of its base weight's norm, so that it changes the bf16 weights visibly (the
effect table's yardstick) without swamping them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

RANK = 4
REL_NORM = 0.05
TARGETS = (".attn.to_q.", ".attn.to_k.", ".attn.to_v.", ".attn.to_out.0.", ".attn.add_q_proj.", ".attn.add_k_proj.",
           ".attn.add_v_proj.", ".attn.to_add_out.", ".attn.to_qkv_mlp_proj.", ".attn.to_out.")


def _weights(transformer: Path) -> dict[str, torch.Tensor]:
    """The attention projection weights of a converted transformer folder, in float32."""
    found = {}
    for file in sorted(Path(transformer).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                if key.endswith(".weight") and any(t in key for t in TARGETS):
                    tensor = f.get_tensor(key)
                    if tensor.dim() == 2:
                        found[key[: -len(".weight")]] = tensor.float()
    return found


def write_tiny_lora(path: str | Path, transformer: str | Path, rank: int = RANK, seed: int = 2) -> Path:
    """Write a rank-`rank` LoRA for the attention projections of the diffusers transformer folder `transformer`."""
    modules = _weights(Path(transformer))
    if not modules:
        raise ValueError(f"{transformer}: no attention projection weight to make a LoRA for")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, weight in sorted(modules.items()):
        out_features, in_features = weight.shape
        down = torch.randn(rank, in_features, generator=g) / in_features ** 0.5
        up = torch.randn(out_features, rank, generator=g)
        up *= REL_NORM * weight.norm() / (up @ down).norm()
        tensors[f"transformer.{module}.lora_A.weight"] = down.to(torch.bfloat16).contiguous()
        tensors[f"transformer.{module}.lora_B.weight"] = up.to(torch.bfloat16).contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt", "made_by": "flux-port demo (tiny random LoRA)"})
    return path
