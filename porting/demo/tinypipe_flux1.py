"""A tiny FLUX.1 [dev] / [schnell] base repository built fully offline, for the demo, the tests and CI.

Every component is the real class `FluxPipeline` takes, at toy size:
- tokenizer: `CLIPTokenizer` (byte-level BPE over the 256 byte symbols, each also as a word-final `</w>` symbol,
  no merges, 77 tokens as CLIP's context); text encoder `CLIPTextModel` of width 24, whose pooled output feeds the
  transformer's `pooled_projection_dim = 24`;
- tokenizer_2: `T5TokenizerFast` (unigram over the byte symbols and the `▁` word marker), text_encoder_2
  `T5EncoderModel` with `d_model = 32 = joint_attention_dim`;
- VAE: `AutoencoderKL` in the FLUX.1 layout (no quant convs, FLUX.1's scaling and shift factors) with 4 latent
  channels: `in_channels = 4 x 4 = 16` (the real one has 16 latent channels and 64);
- scheduler: `FlowMatchEulerDiscreteScheduler` with FLUX.1-dev's settings;
- transformer: `porting.families.flux1` TINY (random base weights); [schnell] has no guidance embedder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from porting.families.flux1 import TINY as TINY_FLUX1

from .tinypipe import TINY_SCHEDULER, byte_symbols

CLIP_SPECIALS = ("<|startoftext|>", "<|endoftext|>")

TINY_CLIP: dict[str, Any] = {
    "hidden_size": 24, "intermediate_size": 48, "projection_dim": 24, "num_hidden_layers": 2,
    "num_attention_heads": 2, "max_position_embeddings": 77,
}

TINY_T5: dict[str, Any] = {
    "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4, "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 32, "feed_forward_proj": "gated-gelu", "is_encoder_decoder": False,
    "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
}

# black-forest-labs/FLUX.1-dev vae/config.json's layout: no quant convs, its scaling and shift factors.
TINY_VAE: dict[str, Any] = {
    "sample_size": 32, "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
    "block_out_channels": [8, 8], "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 4,
    "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False,
}

# The transformer configs the tiny bases declare; a fine-tune from
# `porting.demo.tiny.write_random_checkpoint(..., config, table="flux1")` fits them.
TINY_DEV: dict[str, Any] = {**TINY_FLUX1, "guidance_embeds": True}
TINY_SCHNELL: dict[str, Any] = {**TINY_FLUX1, "guidance_embeds": False}
if (TINY_FLUX1["joint_attention_dim"] != TINY_T5["d_model"]
        or TINY_FLUX1["pooled_projection_dim"] != TINY_CLIP["hidden_size"]
        or TINY_FLUX1["in_channels"] != 4 * TINY_VAE["latent_channels"]):
    raise RuntimeError("porting.families.flux1 TINY no longer fits the tiny FLUX.1 base: joint_attention_dim must "
                       f"be T5 d_model {TINY_T5['d_model']}, pooled_projection_dim CLIP width "
                       f"{TINY_CLIP['hidden_size']}, in_channels 4 x {TINY_VAE['latent_channels']}.")


def clip_tokenizer() -> Any:
    """CLIP's byte-level BPE over an in-memory vocabulary: 256 byte symbols, the same as word ends, 2 specials."""
    from transformers import CLIPTokenizer

    symbols = byte_symbols()
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({s + "</w>": len(symbols) + i for i, s in enumerate(symbols)})
    for tok in CLIP_SPECIALS:
        vocab[tok] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = TINY_CLIP["max_position_embeddings"]
    return tokenizer


def t5_tokenizer() -> Any:
    """A T5 unigram tokenizer over the byte symbols and the `▁` word marker (ids 0-2: pad, eos, unk)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(s, -1.0) for s in byte_symbols()]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0)
    tokenizer.model_max_length = 512
    return tokenizer


def tiny_components(seed: int = 0, guidance: bool = True) -> dict[str, Any]:
    """The seven `FluxPipeline` components, deterministic in `seed`; `guidance=False` is [schnell]."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = clip_tokenizer(), t5_tokenizer()
    bos, eos = (tokenizer.convert_tokens_to_ids(t) for t in CLIP_SPECIALS)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos,
                                                pad_token_id=eos, **TINY_CLIP)).eval()
    torch.manual_seed(seed + 1)
    text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), **TINY_T5)).eval()
    torch.manual_seed(seed + 2)
    vae = AutoencoderKL(**TINY_VAE).eval()
    torch.manual_seed(seed + 3)
    config = TINY_DEV if guidance else TINY_SCHNELL
    transformer = FluxTransformer2DModel(**{k: v for k, v in config.items() if not k.startswith("_")}).eval()
    return {"scheduler": FlowMatchEulerDiscreteScheduler(**TINY_SCHEDULER), "vae": vae,
            "text_encoder": text_encoder, "tokenizer": tokenizer, "text_encoder_2": text_encoder_2,
            "tokenizer_2": tokenizer_2, "transformer": transformer}


def build_base(folder: str | Path, seed: int = 0, guidance: bool = True) -> Path:
    """Write a tiny FLUX.1 [dev] (`guidance=True`) or [schnell] base repository in diffusers layout: what
    `FluxPipeline.from_pretrained(folder)` loads, with a README.md carrying a licence line as a real base has."""
    from diffusers import FluxPipeline

    folder = Path(folder)
    name = "FLUX.1 [dev]" if guidance else "FLUX.1 [schnell]"
    FluxPipeline(**tiny_components(seed, guidance)).save_pretrained(folder)
    (folder / "README.md").write_text(
        "---\nlicense: apache-2.0\nlibrary_name: diffusers\npipeline_tag: text-to-image\n---\n\n"
        f"# tiny {name} base\n\nRandom weights at toy size, built offline by flux-port for its demo and "
        "tests. Not a model: images are noise.\n")
    (folder / "flux-port-base.json").write_text(json.dumps(
        {"tool": "flux-port", "what": f"tiny offline {name} base", "seed": seed}, indent=2) + "\n")
    return folder
