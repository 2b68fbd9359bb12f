"""4-bit text encoders as Nunchaku ships them (AWQ W4A16, TinyChat layout), written by deepcompressor's own TinyChat
writer (`deepcompressor.backend.tinychat.convert`), and decoded by an independent re-implementation of the Qwen3
loader's `_unpack_tinychat_w4` / `_dequant_tinychat_linear` (shared/nunchaku-dialects.md section 1): never by
flux-port's code, so the tests compare flux-port with the producer and the consumer.

Tiny models in the real architectures (transformers' Qwen3Model, T5EncoderModel), widths multiples of 128 so
group 128 fits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

tinychat = pytest.importorskip("deepcompressor.backend.tinychat.convert",
                               reason="deepcompressor-toolkit (the TinyChat writer, the test oracle) is installed "
                                      "with --no-deps by .ci/run")

TINY_QWEN3 = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 320, "max_position_embeddings": 512,
              "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
TINY_T5 = {"d_model": 128, "d_kv": 64, "d_ff": 256, "num_layers": 2, "num_heads": 2, "vocab_size": 320,
           "relative_attention_num_buckets": 32, "feed_forward_proj": "gated-gelu", "is_encoder_decoder": False,
           "use_cache": False}


def qwen3_model(seed: int = 0, config: dict | None = None) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    return Qwen3Model(Qwen3Config(**(config or TINY_QWEN3))).eval()


def t5_model(seed: int = 0, config: dict | None = None) -> torch.nn.Module:
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    return T5EncoderModel(T5Config(**(config or TINY_T5))).eval()


def asymmetric(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per (row, group), min-max asymmetric 4-bit: w + zero over scale lands in 0..15."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scale = ((hi - lo) / 15).clamp(min=1e-6)
    return scale, -lo


def quantized_state(model: torch.nn.Module, group: int = 128, dtype: torch.dtype = torch.bfloat16,
                    skip: tuple[str, ...] = ("embed", "shared", "norm", "relative_attention_bias", "lm_head")
                    ) -> dict[str, torch.Tensor]:
    """The model's state dict with every linear weight (2-D, not embeddings or norms) written by deepcompressor's
    TinyChat writer; the rest in `dtype`."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name.endswith(".weight") and t.dim() == 2 and not any(s in name for s in skip):
            w = t.to(dtype)
            scale, zero = asymmetric(w, group)
            out.update(tinychat.convert_to_tinychat_w4x16y16_linear_state_dict(name, w, scale, zero,
                                                                               zero_pre_scaled=False))
        else:
            out[name] = t.to(dtype).contiguous()
    return out


def qwen3_metadata(config: dict, group: int = 128) -> dict[str, str]:
    """What tonera's Qwen3 dispatcher reads: the config (rope_parameters spelled), the group, the usage."""
    cfg = {**config, "model_type": "qwen3", "architectures": ["Qwen3Model"],
           "rope_parameters": {"rope_type": "default", "rope_theta": config.get("rope_theta", 1000000.0)}}
    return {"config": json.dumps(cfg), "quantization_config": json.dumps({"weight": {"group_size": group}}),
            "text_encoder_usage": "qwen3_text_only", "model_type": "qwen3_text"}


def t5_metadata(config: dict) -> dict[str, str]:
    return {"config": json.dumps({**config, "model_type": "t5", "architectures": ["T5EncoderModel"]})}


def save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    return path


def write_qwen3_file(path: Path, seed: int = 0, group: int = 128) -> Path:
    return save(path, quantized_state(qwen3_model(seed), group), qwen3_metadata(TINY_QWEN3, group))


def write_t5_file(path: Path, seed: int = 0) -> Path:
    return save(path, quantized_state(t5_model(seed), 128), t5_metadata(TINY_T5))


# The consumer's side, written from the loaders' description, not from flux-port's decoder.
def unpack_tinychat_w4(qweight: torch.Tensor) -> torch.Tensor:
    """int16 [n/4, k] -> codes [n, k] in 0..15 (the inverse of TinyChat's pack_w4)."""
    quarter, k = qweight.shape
    n = 4 * quarter
    words = qweight.view(quarter, k // 64, 4, 16).permute(0, 2, 1, 3).reshape(-1, 8).to(torch.int32) & 0xFFFF
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(4)], dim=1)  # [words/8, 4, 8]
    return nibbles.reshape(n, k)


def dequant_tinychat_linear(qweight: torch.Tensor, scales: torch.Tensor, scaled_zeros: torch.Tensor,
                            group: int) -> torch.Tensor:
    """W = q * scales + scaled_zeros per (row, group), float32."""
    q = unpack_tinychat_w4(qweight).float()
    n, k = q.shape
    g = k // group
    s = scales[:g].float().t().repeat_interleave(group, dim=1)
    z = scaled_zeros[:g].float().t().repeat_interleave(group, dim=1)
    return q * s + z


def oracle_state(tensors: dict[str, torch.Tensor], group: int = 128) -> dict[str, torch.Tensor]:
    """The file's tensors as the loaders' arithmetic sees them: every 4-bit linear dequantized to float32."""
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        if key.endswith(".qweight"):
            p = key[: -len("qweight")]
            out[p + "weight"] = dequant_tinychat_linear(t, tensors[p + "scales"], tensors[p + "scaled_zeros"], group)
        elif not key.endswith((".scales", ".scaled_zeros")):
            out[key] = t
    return out
