"""What each exportable component is: the torch module traced, its named inputs and outputs, which axes are dynamic,
and a small example input to trace with.

Example sizes are never 1 and never equal to one another: torch.export specialises a dynamic dimension whose example
is 0 or 1, and may merge two dynamic dimensions whose examples coincide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

TEXT_ENCODER_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers


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


class VaeDecoderGraph(nn.Module):
    """AutoencoderKLFlux2.decode: unpatchified, de-normalised latents to an image in [-1, 1]."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latent_sample, return_dict=False)[0]


class TextEncoderGraph(nn.Module):
    """Qwen3 hidden states of the pipeline's layers, stacked as Flux2KleinPipeline._get_qwen3_prompt_embeds does."""

    def __init__(self, encoder: nn.Module, layers: tuple[int, ...]) -> None:
        super().__init__()
        self.encoder, self.layers = encoder, layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.encoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                           use_cache=False)
        stacked = torch.stack([out.hidden_states[k] for k in self.layers], dim=1)
        b, n, t, d = stacked.shape
        return stacked.permute(0, 2, 1, 3).reshape(b, t, n * d)


@dataclass
class Traceable:
    module: nn.Module
    example: dict[str, torch.Tensor]
    dynamic: dict[str, dict[int, str]]  # input name -> {axis: dimension name}
    outputs: list[str]
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def inputs(self) -> list[str]:
        return list(self.example)


@dataclass(frozen=True)
class Component:
    name: str  # folder in the export
    source: str  # folder in the diffusers pipeline
    load: Callable[[Path, torch.dtype], Traceable]
    count_params: Callable[[Path], int]


def _read_config(folder: Path) -> dict[str, Any]:
    from porting._files import read_config

    config = read_config(folder / "config.json", "a component config")
    return {k: v for k, v in config.items() if not k.startswith("_")}


def _quiet_from_pretrained(cls: Any, folder: Path, dtype: torch.dtype, **kw: Any) -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(folder, dtype=dtype, local_files_only=True, **kw).eval().requires_grad_(False)


def _count_meta(build: Callable[[], nn.Module]) -> int:
    with torch.device("meta"):
        model = build()
    return sum(p.numel() for p in model.parameters())


def load_transformer(folder: Path, dtype: torch.dtype) -> Traceable:
    from diffusers import Flux2KleinPipeline, Flux2Transformer2DModel

    model = _quiet_from_pretrained(Flux2Transformer2DModel, folder, dtype)
    cfg = model.config
    batch, img_side, txt = 2, 4, 6
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(batch, txt, cfg.joint_attention_dim, generator=gen).to(dtype)
    example = {
        "hidden_states": torch.randn(batch, img_side * img_side, cfg.in_channels, generator=gen).to(dtype),
        "encoder_hidden_states": ctx,
        "timestep": torch.full((batch,), 0.5, dtype=dtype),
        "img_ids": Flux2KleinPipeline._prepare_latent_ids(torch.empty(batch, 1, img_side, img_side)),
        "txt_ids": Flux2KleinPipeline._prepare_text_ids(ctx),
    }
    dynamic = {"hidden_states": {0: "batch", 1: "image_tokens"},
               "encoder_hidden_states": {0: "batch", 1: "text_tokens"}, "timestep": {0: "batch"},
               "img_ids": {0: "batch", 1: "image_tokens"},
               "txt_ids": {0: "batch", 1: "text_tokens"}}
    graph: nn.Module = TransformerGraph(model)
    if cfg.guidance_embeds:
        example["guidance"] = torch.full((batch,), 4.0, dtype=dtype)
        dynamic["guidance"] = {0: "batch"}
        graph = GuidedTransformerGraph(model)
    return Traceable(graph, example, dynamic, ["sample"], {"timestep": "sigma in [0, 1] (the pipeline's t / 1000)"})


def count_transformer(folder: Path) -> int:
    from diffusers import Flux2Transformer2DModel

    return _count_meta(lambda: Flux2Transformer2DModel.from_config(_read_config(folder)))


def load_vae_decoder(folder: Path, dtype: torch.dtype) -> Traceable:
    from diffusers import AutoencoderKLFlux2

    vae = _quiet_from_pretrained(AutoencoderKLFlux2, folder, dtype)
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, vae.config.latent_channels, 6, 5, generator=gen).to(dtype)
    return Traceable(VaeDecoderGraph(vae), {"latent_sample": latents},
                     {"latent_sample": {0: "batch", 2: "latent_height", 3: "latent_width"}}, ["sample"],
                     {"input": "unpatchified latents after the pipeline's batch-norm de-normalisation"})


def count_vae_decoder(folder: Path) -> int:
    from diffusers import AutoencoderKLFlux2

    return _count_meta(lambda: AutoencoderKLFlux2.from_config(_read_config(folder)))


def load_text_encoder(folder: Path, dtype: torch.dtype) -> Traceable:
    from transformers import AutoModelForCausalLM

    encoder = _quiet_from_pretrained(AutoModelForCausalLM, folder, dtype)
    n_layers = encoder.config.num_hidden_layers
    layers = (TEXT_ENCODER_LAYERS if max(TEXT_ENCODER_LAYERS) <= n_layers else
              tuple(max(1, round(n_layers * k / 3)) for k in (1, 2, 3)))
    ids = torch.randint(0, encoder.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    return Traceable(TextEncoderGraph(encoder, layers), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                     {"input_ids": {0: "batch", 1: "text_tokens"}, "attention_mask": {0: "batch", 1: "text_tokens"}},
                     ["prompt_embeds"], {"hidden_states_layers": list(layers)})


def count_text_encoder(folder: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
    return _count_meta(lambda: AutoModelForCausalLM.from_config(cfg))


COMPONENTS: dict[str, Component] = {
    "transformer": Component("transformer", "transformer", load_transformer, count_transformer),
    "vae_decoder": Component("vae_decoder", "vae", load_vae_decoder, count_vae_decoder),
    "text_encoder": Component("text_encoder", "text_encoder", load_text_encoder, count_text_encoder),
}
COPIED = ("tokenizer", "scheduler")  # no weights: copied as they are


def nbytes(params: int, dtype: torch.dtype) -> int:
    return params * torch.empty((), dtype=dtype).element_size()


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
