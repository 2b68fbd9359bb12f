"""A tiny FLUX.2 [dev] base repository built fully offline, for the demo, the tests and CI.

`Flux2Pipeline` with its real component classes at toy size:
- text encoder: `Mistral3ForConditionalGeneration` whose language model has hidden 16 and **30 layers**, so the
  pipeline's default `text_encoder_out_layers=(10, 20, 30)` applies unchanged: `joint_attention_dim = 3 x 16 = 48`
  (the same as the klein tiny base); its Pixtral vision tower is one layer (text-to-image never runs it);
- tokenizer: a byte-level BPE tokenizer (256 byte symbols, Mistral's control tokens, no merges) with a Mistral
  chat template for the pipeline's system + user messages. The real repository has a `PixtralProcessor` there,
  which transformers only builds with torchvision installed; the pipeline calls nothing but `apply_chat_template`
  on it for text-to-image (reference images go to the VAE), which the tokenizer answers the same way;
- VAE and scheduler: as the klein tiny base (`AutoencoderKLFlux2` with 4 latent channels: in_channels 16);
- transformer: `porting.families.flux2` TINY with `guidance_embeds=True` (random base weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from porting.families.flux2 import TINY as TINY_FLUX2

from .tinypipe import TINY_SCHEDULER, TINY_VAE, byte_symbols

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                  "[IMG]", "[IMG_BREAK]", "[IMG_END]")

# Mistral Small 3's format for the messages Flux2Pipeline sends: content is a list of {"type": "text"} parts.
CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{ '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{ text + eos_token }}{%- endif %}{%- endfor %}"
)

TINY_TEXT: dict[str, Any] = {
    "model_type": "mistral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 30,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 1024,
    "rope_theta": 1e6,
}
TINY_VISION: dict[str, Any] = {
    "model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
    "num_attention_heads": 2, "head_dim": 8, "patch_size": 16, "image_size": 64,
}

TINY_DEV: dict[str, Any] = {**TINY_FLUX2, "guidance_embeds": True}
if (TINY_DEV["joint_attention_dim"] != 3 * TINY_TEXT["hidden_size"]
        or TINY_DEV["in_channels"] != 4 * TINY_VAE["latent_channels"]):
    raise RuntimeError("porting.families.flux2 TINY no longer fits the tiny FLUX.2 [dev] base: joint_attention_dim "
                       f"must be 3 x {TINY_TEXT['hidden_size']} and in_channels 4 x {TINY_VAE['latent_channels']}.")


def tiny_tokenizer() -> Any:
    """Byte-level BPE with Mistral's control tokens first, then the 256 byte symbols: 267 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for symbol in byte_symbols():
        vocab[symbol] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>", model_max_length=512,
                                        extra_special_tokens=list(SPECIAL_TOKENS[4:]))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_components(seed: int = 0) -> dict[str, Any]:
    """The five `Flux2Pipeline` components, deterministic in `seed`."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tokenizer = tiny_tokenizer()
    config = Mistral3Config(text_config={**TINY_TEXT, "vocab_size": len(tokenizer)}, vision_config=TINY_VISION,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2)
    torch.manual_seed(seed)
    text_encoder = Mistral3ForConditionalGeneration(config).eval()
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLFlux2(**TINY_VAE).eval()
    torch.manual_seed(seed + 2)
    transformer = Flux2Transformer2DModel(**{k: v for k, v in TINY_DEV.items() if not k.startswith("_")}).eval()
    return {"scheduler": FlowMatchEulerDiscreteScheduler(**TINY_SCHEDULER), "vae": vae,
            "text_encoder": text_encoder, "tokenizer": tokenizer, "transformer": transformer}


def build_base(folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny FLUX.2 [dev] base repository in diffusers layout (what `Flux2Pipeline.from_pretrained(folder)`
    loads), with a README.md carrying a licence line as a real base has."""
    from diffusers import Flux2Pipeline

    folder = Path(folder)
    Flux2Pipeline(**tiny_components(seed)).save_pretrained(folder)
    (folder / "README.md").write_text(
        "---\nlicense: apache-2.0\nlibrary_name: diffusers\npipeline_tag: text-to-image\n---\n\n"
        "# tiny FLUX.2 [dev] base\n\nRandom weights at toy size, built offline by flux-port for its demo and "
        "tests. Not a model: images are noise.\n")
    (folder / "flux-port-base.json").write_text(json.dumps(
        {"tool": "flux-port", "what": "tiny offline FLUX.2 [dev] base", "seed": seed}, indent=2) + "\n")
    return folder
