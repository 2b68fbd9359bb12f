"""A tiny FLUX.2 [klein] base repository built fully offline, for the demo, the tests and CI.

Every component is the real class at toy size (flux2-checkpoints.md section 9):
- tokenizer: byte-level BPE over the 256 byte symbols plus the five Qwen3 special tokens, no merges, with a
  Qwen3-style chat template (so `apply_chat_template(..., enable_thinking=False)` renders the same shape of text);
- text encoder: `Qwen3ForCausalLM`, hidden 16 and **27 layers**, so the pipelines' default
  `text_encoder_out_layers=(9, 18, 27)` applies unchanged and a published tiny folder runs with plain
  `Flux2KleinPipeline.from_pretrained(folder)(prompt)`; `joint_attention_dim = 3 x 16 = 48`;
- VAE: `AutoencoderKLFlux2` with two blocks of 8 channels and 4 latent channels: `in_channels = 4 x 4 = 16`;
- scheduler: `FlowMatchEulerDiscreteScheduler` with the FLUX shift settings;
- transformer: `porting.demo.tiny.TINY_FLUX2` (random base weights), which the sizes above fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .tiny import TINY_FLUX2

# Qwen3 special tokens, in the order the tiny vocabulary appends them after the 256 byte symbols.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# Qwen3's chat format: user turns, then the assistant header; with enable_thinking=false an empty think block.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)

TINY_TEXT_ENCODER: dict[str, Any] = {
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 27, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 512, "tie_word_embeddings": True,
}

TINY_VAE: dict[str, Any] = {
    "sample_size": 32, "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
    "block_out_channels": [8, 8], "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 4,
}

# The FLUX.1-dev scheduler settings the diffusers FLUX.2 conversion script uses (section 8.5).
TINY_SCHEDULER: dict[str, Any] = {
    "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
    "base_image_seq_len": 256, "max_image_seq_len": 4096,
}

# The transformer the tiny base declares; a tiny fine-tune from `porting.demo.tiny.write_random_checkpoint(...,
# TINY_FLUX2)` fits it. Checked here so a change to TINY_FLUX2 fails loudly instead of producing a broken base.
TINY_BASE_TRANSFORMER: dict[str, Any] = dict(TINY_FLUX2)
if (TINY_BASE_TRANSFORMER["joint_attention_dim"] != 3 * TINY_TEXT_ENCODER["hidden_size"]
        or TINY_BASE_TRANSFORMER["in_channels"] != 4 * TINY_VAE["latent_channels"]):
    raise RuntimeError("porting.demo.tiny.TINY_FLUX2 no longer fits the tiny base: joint_attention_dim must be 3 x "
                       f"{TINY_TEXT_ENCODER['hidden_size']} and in_channels 4 x {TINY_VAE['latent_channels']}.")


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins of byte-level BPE: printable Latin-1 bytes map to themselves, the rest to
    code points from 256 upwards, in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, extra = [], 0
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def tiny_tokenizer() -> Any:
    """A Qwen2 tokenizer (the class Qwen3 uses) over an in-memory byte-level vocabulary: 261 tokens."""
    from transformers import Qwen2Tokenizer

    vocab = {s: i for i, s in enumerate(byte_symbols())}
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<|endoftext|>", bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>",
                               additional_special_tokens=list(SPECIAL_TOKENS[1:]))
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 512
    return tokenizer


# The wide variant (`port demo --family klein-wide`): every width a multiple of 128, so the Nunchaku 4-bit writers
# (SVDQuant for the transformer, AWQ W4A16 group 128 for the text encoder) take it. Text hidden 128 (27 layers, for
# the pipeline's default output layers), inner width 2 x 64 = 128, MLP 384, joint_attention_dim 3 x 128.
WIDE_TEXT_ENCODER: dict[str, Any] = {
    **TINY_TEXT_ENCODER, "hidden_size": 128, "intermediate_size": 256, "head_dim": 64,
}
WIDE_TRANSFORMER: dict[str, Any] = {
    **TINY_FLUX2, "attention_head_dim": 64, "num_attention_heads": 2, "joint_attention_dim": 384,
    "axes_dims_rope": [16, 16, 16, 16],
}


def tiny_components(seed: int = 0, wide: bool = False) -> dict[str, Any]:
    """scheduler, vae, text_encoder, tokenizer and a random base transformer, deterministic in `seed` (`wide`: the
    variant whose widths are multiples of 128)."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    text_config = WIDE_TEXT_ENCODER if wide else TINY_TEXT_ENCODER
    text_encoder = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), **text_config)).eval()
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(**TINY_VAE).eval()
    torch.manual_seed(seed + 2)
    transformer_cfg = {k: v for k, v in (WIDE_TRANSFORMER if wide else TINY_BASE_TRANSFORMER).items()
                       if not k.startswith("_")}
    transformer = Flux2Transformer2DModel(**transformer_cfg).eval()
    return {"scheduler": FlowMatchEulerDiscreteScheduler(**TINY_SCHEDULER), "vae": vae,
            "text_encoder": text_encoder, "tokenizer": tokenizer, "transformer": transformer}


def build_demo_base(folder: str | Path, seed: int = 0, wide: bool = False) -> Path:
    """Write a tiny FLUX.2 [klein] (distilled) base repository in diffusers layout and return its path.

    The folder has what a real base repository has: `model_index.json` (Flux2KleinPipeline, is_distilled true),
    `scheduler/`, `text_encoder/`, `tokenizer/`, `vae/`, `transformer/` (config and random base weights), and a
    README.md with a licence line, as publish carries the licence into the model card.
    """
    from diffusers import Flux2KleinPipeline

    folder = Path(folder)
    pipe = Flux2KleinPipeline(**tiny_components(seed, wide), is_distilled=True)
    pipe.save_pretrained(folder)
    (folder / "README.md").write_text(
        "---\nlicense: apache-2.0\nlibrary_name: diffusers\npipeline_tag: text-to-image\n---\n\n"
        "# tiny FLUX.2 [klein] base\n\nRandom weights at toy size, built offline by flux-port for its demo and "
        "tests. Not a model: images are noise.\n")
    (folder / "flux-port-base.json").write_text(json.dumps(
        {"tool": "flux-port", "what": "tiny offline FLUX.2 [klein] base", "seed": seed}, indent=2) + "\n")
    return folder
