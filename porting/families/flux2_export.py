"""FLUX.2's exportable components (klein, klein-kv, dev): `Flux2Transformer2DModel`, `AutoencoderKLFlux2.decode`
and the text encoder's stacked hidden states (Qwen3 for klein, Mistral3 for dev), with example inputs built as the
FLUX.2 pipelines build them. Imported by `port export` only (torch, diffusers and transformers are loaded here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from porting.families.export_spec import (
    Component,
    ExportSpec,
    Traceable,
    count_diffusers,
    count_meta,
    load_vae_decoder,
    quiet_from_pretrained,
)

from .base import Family, PipelineVariant

TEXT_ENCODER_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers
RYZENAI_VARIANTS = ("klein", "klein-kv")  # the Ryzen AI flow (porting/export/ryzenai.py) is written for klein
TRANSFORMER_FACTS = {"timestep": "sigma in [0, 1] (the pipeline's t / 1000)"}


class TransformerGraph(nn.Module):
    """Flux2Transformer2DModel.forward with the pipeline's keyword names as positional graph inputs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                img_ids: torch.Tensor, txt_ids: torch.Tensor) -> torch.Tensor:
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]


class GuidedTransformerGraph(TransformerGraph):
    """The same for guidance-distilled models (FLUX.2 dev), which take a `guidance` input."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                img_ids: torch.Tensor, txt_ids: torch.Tensor, guidance: torch.Tensor) -> torch.Tensor:
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          timestep=timestep, img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                          return_dict=False)[0]


class TextEncoderGraph(nn.Module):
    """The text encoder's hidden states of the pipeline's layers, stacked as the FLUX.2 pipelines do
    (Flux2KleinPipeline._get_qwen3_prompt_embeds, Flux2Pipeline._get_mistral_3_small_prompt_embeds)."""

    def __init__(self, encoder: nn.Module, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.encoder, self.layers = encoder, layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                           use_cache=False)
        stacked = torch.stack([out.hidden_states[k] for k in self.layers], dim=1)
        b, n, t, d = stacked.shape
        return stacked.permute(0, 2, 1, 3).reshape(b, t, n * d)


def transformer_graph(model: nn.Module) -> TransformerGraph:
    return (GuidedTransformerGraph if model.config.guidance_embeds else TransformerGraph)(model)


def transformer_example(config: Any, dtype: torch.dtype, batch: int, img_side: int,
                        txt: int) -> dict[str, torch.Tensor]:
    """Inputs as the FLUX.2 pipelines build them: packed latents, 4-axis ids, sigma, guidance when the model has it."""
    from diffusers import Flux2KleinPipeline

    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(batch, txt, config.joint_attention_dim, generator=gen).to(dtype)
    example = {
        "hidden_states": torch.randn(batch, img_side * img_side, config.in_channels, generator=gen).to(dtype),
        "encoder_hidden_states": ctx,
        "timestep": torch.full((batch,), 0.5, dtype=dtype),
        "img_ids": Flux2KleinPipeline._prepare_latent_ids(torch.empty(batch, 1, img_side, img_side)),
        "txt_ids": Flux2KleinPipeline._prepare_text_ids(ctx),
    }
    if config.guidance_embeds:
        example["guidance"] = torch.full((batch,), 4.0, dtype=dtype)
    return example


def load_transformer(folder: Path, dtype: torch.dtype) -> Traceable:
    from diffusers import Flux2Transformer2DModel

    model = quiet_from_pretrained(Flux2Transformer2DModel, folder, dtype)
    example = transformer_example(model.config, dtype, batch=2, img_side=4, txt=6)
    dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"},
               "encoder_hidden_states": {0: "batch", 1: "text_tokens"}, "timestep": {0: "batch"},
               "img_ids": {0: "batch", 1: "image_tokens"}, "txt_ids": {0: "batch", 1: "text_tokens"}}
    if "guidance" in example:
        dynamic["guidance"] = {0: "batch"}
    return Traceable(transformer_graph(model), example, dynamic, ["sample"], dict(TRANSFORMER_FACTS))


def encoder_layers(n_layers: int, wanted: tuple[int, ...]) -> tuple[int, ...]:
    """The pipeline's layers; for a smaller encoder than the real one (tests, demo) the same relative depths."""
    if max(wanted) <= n_layers:
        return wanted
    return tuple(max(1, round(n_layers * k / len(wanted))) for k in range(1, len(wanted) + 1))


def _text_encoder_class(name: str) -> Any:
    import transformers

    if name.endswith("ForCausalLM"):  # Qwen3ForCausalLM and the like: the auto class picks it from the config
        return transformers.AutoModelForCausalLM
    return getattr(transformers, name)


def text_encoder_loader(cls_name: str, wanted: tuple[int, ...]) -> Any:
    def load(folder: Path, dtype: torch.dtype) -> Traceable:
        encoder = quiet_from_pretrained(_text_encoder_class(cls_name), folder, dtype)
        text_config = getattr(encoder.config, "text_config", encoder.config)
        layers = encoder_layers(text_config.num_hidden_layers, wanted)
        ids = torch.randint(0, text_config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
        return Traceable(TextEncoderGraph(encoder, layers), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                         {"input_ids": {0: "batch", 1: "text_tokens"},
                          "attention_mask": {0: "batch", 1: "text_tokens"}},
                         ["prompt_embeds"], {"hidden_states_layers": list(layers)})
    return load


def text_encoder_counter(cls_name: str) -> Any:
    def count(folder: Path) -> int:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
        cls = _text_encoder_class(cls_name)
        build = (lambda: cls.from_config(cfg)) if hasattr(cls, "from_config") else (lambda: cls(cfg))
        return count_meta(build)
    return count


# what `port validate` of a ryzenai text encoder export (klein's Qwen3) loads as its golden
load_text_encoder = text_encoder_loader("Qwen3ForCausalLM", TEXT_ENCODER_LAYERS)


def _vae_facts(config: Any) -> dict[str, Any]:
    return {"input": "unpatchified latents after the pipeline's batch-norm de-normalisation"}


def export_spec(family: Family, config: Mapping[str, Any], variant: PipelineVariant | None,
                variant_name: str | None) -> ExportSpec:
    variant = variant or family.pipelines["klein"]
    return ExportSpec(
        title=variant.title,
        components={
            "transformer": Component("transformer", "transformer", load_transformer,
                                     count_diffusers("Flux2Transformer2DModel")),
            "vae_decoder": Component("vae_decoder", "vae", load_vae_decoder("AutoencoderKLFlux2", _vae_facts),
                                     count_diffusers("AutoencoderKLFlux2")),
            "text_encoder": Component("text_encoder", "text_encoder",
                                      text_encoder_loader(variant.text_encoder, variant.out_layers),
                                      text_encoder_counter(variant.text_encoder)),
        },
        copied=("tokenizer", "scheduler"),
        ryzenai=variant_name in RYZENAI_VARIANTS,
    )
