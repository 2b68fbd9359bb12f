"""FLUX.2 stages (`Flux2Transformer2DModel`: klein, klein-kv, dev) and inputs as the FLUX.2 pipelines build them.

Stages call the diffusers model's own submodules in the order of `Flux2Transformer2DModel.forward`: `embed` (time
and guidance embedding, the three modulations, x and context embedders, RoPE of text and image ids), the double
blocks, the single blocks (on the joint stream, text first) and `final` on the image tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from porting.errors import InputError

from ._flux_stages import (
    ROPE,
    VAE_SCALE,
    FluxStages,
    State,
    description,
    encoder_layers,
    features_error,
    pipeline_class_name,
    require_folders,
)
from .flux2 import FAMILY


class Flux2Stages(FluxStages):
    embed_modules = ("time_guidance_embed", "double_stream_modulation_img", "double_stream_modulation_txt",
                     "single_stream_modulation", "x_embedder", "context_embedder")
    embed_judged = ("img", "txt", "mod_img", "mod_txt", "mod_single")
    guidance_scale = 4.0  # Flux2Pipeline's default guidance_scale
    labels = {"embed": "img_in, txt_in, time_in, *_modulation", "final": "final_layer"}
    text_encoders = ("text_encoder",)

    def embed(self, m: nn.Module, s: State) -> State:
        timestep, guidance = self.scaled_times(s, s["x"].dtype)
        temb = m.time_guidance_embed(timestep, guidance)
        img_ids = s["img_ids"][0] if s["img_ids"].ndim == 3 else s["img_ids"]
        txt_ids = s["txt_ids"][0] if s["txt_ids"].ndim == 3 else s["txt_ids"]
        img_rope, txt_rope = m.pos_embed(img_ids), m.pos_embed(txt_ids)
        return {
            "temb": temb,
            "mod_img": m.double_stream_modulation_img(temb),
            "mod_txt": m.double_stream_modulation_txt(temb),
            "mod_single": m.single_stream_modulation(temb),
            "img": m.x_embedder(s["x"]),
            "txt": m.context_embedder(s["ctx"]),
            ROPE: (torch.cat([txt_rope[0], img_rope[0]], dim=0), torch.cat([txt_rope[1], img_rope[1]], dim=0)),
            "n_txt": s["ctx"].shape[1],
        }

    @staticmethod
    def _shared(s: State) -> State:
        return {k: s[k] for k in ("temb", "mod_img", "mod_txt", "mod_single", ROPE, "n_txt")}

    def double(self, block: nn.Module, s: State) -> State:
        txt, img = block(hidden_states=s["img"], encoder_hidden_states=s["txt"], temb_mod_img=s["mod_img"],
                         temb_mod_txt=s["mod_txt"], image_rotary_emb=s[ROPE], joint_attention_kwargs=None)
        return {**self._shared(s), "img": img, "txt": txt}

    def single(self, block: nn.Module, s: State) -> State:
        joint = block(hidden_states=self.stream(s), encoder_hidden_states=None, temb_mod=s["mod_single"],
                      image_rotary_emb=s[ROPE], joint_attention_kwargs=None)
        return {**self._shared(s), "joint": joint}

    def final(self, m: nn.Module, s: State) -> State:
        hidden = self.stream(s)[:, s["n_txt"]:, ...]
        return {"out": m.proj_out(m.norm_out(hidden, s["temb"]))}

    # ------------------------------------------------------------------------------------------------ inputs

    def latent_shape(self, config: Mapping[str, Any], resolution: int) -> tuple[int, ...]:
        side = resolution // (VAE_SCALE * 2)  # the pipeline's latents are already 2x2-patchified
        return (int(config["in_channels"]), side, side)

    def text_shapes(self, config: Mapping[str, Any], text_len: int) -> dict[str, tuple[int, ...]]:
        return {"ctx": (text_len, int(config["joint_attention_dim"]))}

    def model_inputs(self, config: Mapping[str, Any], latents: torch.Tensor, text: Mapping[str, torch.Tensor],
                     timesteps: torch.Tensor) -> State:
        from diffusers import Flux2Pipeline

        ctx = text["ctx"]
        return {"x": Flux2Pipeline._pack_latents(latents), "ctx": ctx, "timestep": timesteps,
                "img_ids": Flux2Pipeline._prepare_latent_ids(latents), "txt_ids": Flux2Pipeline._prepare_text_ids(ctx),
                **self.guidance(config, latents.shape[0])}

    def encode_prompt(self, base: Path, prompt: str, text_len: int, config: Mapping[str, Any],
                      text_encoder: Any = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The base's own text encoder as its pipeline runs it: Qwen3 (klein) or Mistral 3 (dev), the hidden
        states of the pipeline's layers stacked; `text_encoder` (a 4-bit Qwen3, klein only) in its place."""
        declared = pipeline_class_name(base)
        variants = {v.pipeline: v for v in FAMILY.pipelines.values()}
        if declared is not None and declared not in variants:
            raise InputError(f"{base}: the base is a {declared}; a FLUX.2 transformer's prompt is encoded by "
                             f"{', '.join(variants)}.", hint="Is --base the base of this fine-tune?")
        variant = variants[declared] if declared else FAMILY.pipelines[FAMILY.default_variant(config)]
        require_folders(base, ("text_encoder", "tokenizer"))
        enc_dir, tok_dir = base / "text_encoder", base / "tokenizer"
        device = torch.device("cpu")
        if variant.text_encoder == "Mistral3ForConditionalGeneration":
            if text_encoder is not None:
                raise InputError(f"{base}: FLUX.2 [dev]'s Mistral 3 encoder has no 4-bit form flux-port runs; a 4-bit "
                                 "Qwen3 encoder feeds FLUX.2 [klein].", hint="Leave --text-encoder out.")
            from diffusers import Flux2Pipeline
            from transformers import AutoProcessor, Mistral3ForConditionalGeneration

            tokenizer = AutoProcessor.from_pretrained(tok_dir, local_files_only=True)
            encoder = Mistral3ForConditionalGeneration.from_pretrained(enc_dir, dtype=torch.float32,
                                                                      local_files_only=True)
            used = encoder_layers(encoder.config.text_config.num_hidden_layers, variant.out_layers)
            with torch.no_grad():
                feats = Flux2Pipeline._get_mistral_3_small_prompt_embeds(
                    text_encoder=encoder, tokenizer=tokenizer, prompt=[prompt], device=device,
                    max_sequence_length=text_len, hidden_states_layers=used)
        else:
            from diffusers import Flux2KleinPipeline
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
            encoder = AutoModelForCausalLM.from_pretrained(enc_dir, dtype=torch.float32, local_files_only=True)
            used = encoder_layers(encoder.config.num_hidden_layers, variant.out_layers)
            with torch.no_grad():
                feats = Flux2KleinPipeline._get_qwen3_prompt_embeds(
                    text_encoder=encoder, tokenizer=tokenizer, prompt=[prompt], device=device,
                    max_sequence_length=text_len, hidden_states_layers=used)
                if text_encoder is not None:
                    four = Flux2KleinPipeline._get_qwen3_prompt_embeds(
                        text_encoder=text_encoder, tokenizer=tokenizer, prompt=[prompt], device=device,
                        max_sequence_length=text_len, hidden_states_layers=used)
                    error, feats, encoder = features_error(four, feats), four, text_encoder
        extra = {} if text_encoder is None else {"text_encoder_4bit": True, "prompt_features_error": error}
        return {"ctx": feats.float()}, description([encoder], prompt, text_encoder_layers=list(used),
                                                   pipeline=variant.pipeline, **extra)


STAGES = Flux2Stages()
