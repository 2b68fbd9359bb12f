"""What an exportable component is, whatever the family: the torch module traced, its named inputs and outputs,
which axes are dynamic, and a small example input to trace with.

The components themselves (graph wrappers, example inputs) are the family's: each family names a module
(`Family.export_module`) whose `export_spec` returns an `ExportSpec`; `porting/export/onnx_layout.py` asks the
registry for it by the transformer config's `_class_name`.

Example sizes are never 1 and never equal to one another: torch.export specialises a dynamic dimension whose example
is 0 or 1, and may merge two dynamic dimensions whose examples coincide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from porting.skeleton import empty_weights


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


@dataclass(frozen=True)
class ExportSpec:
    """What one model's export holds, as its family declares it."""

    title: str  # the model in messages: "FLUX.1", "FLUX.2 [dev]"
    components: Mapping[str, Component]  # in export order
    copied: tuple[str, ...] = ()  # weightless pipeline folders (tokenizers, scheduler), copied as they are
    ryzenai: bool = False  # whether `--target ryzenai` (the Ryzen AI flow) takes this model
    refused: Mapping[str, str] = field(default_factory=dict)  # component -> why it is not exported


class VaeDecoderGraph(nn.Module):
    """`vae.decode`: the latents the pipeline hands the VAE to an image in [-1, 1] (any diffusers autoencoder)."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, latent_sample: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latent_sample, return_dict=False)[0]


def read_component_config(folder: Path) -> dict[str, Any]:
    """A component's config.json without the `_` bookkeeping fields."""
    from porting._files import read_config

    config = read_config(folder / "config.json", "a component config")
    return {k: v for k, v in config.items() if not k.startswith("_")}


def quiet_from_pretrained(cls: Any, folder: Path, dtype: torch.dtype, **kw: Any) -> Any:
    """`cls.from_pretrained(folder, dtype)`, quietly; inside `streamed.hollow_loading` the module is built from its
    config with hollow weights instead (nothing read: the streamed export writes them tensor by tensor)."""
    import warnings

    from porting.skeleton import hollow_dtype, hollow_pretrained

    if hollow_dtype() is not None:
        return hollow_pretrained(cls, folder, hollow_dtype())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(folder, dtype=dtype, local_files_only=True, **kw).eval().requires_grad_(False)


def count_meta(build: Callable[[], nn.Module]) -> int:
    with empty_weights():
        model = build()
    return sum(p.numel() for p in model.parameters())


def count_diffusers(cls_name: str) -> Callable[[Path], int]:
    """Parameter count of a diffusers model class from a folder's config, built on the meta device."""
    def count(folder: Path) -> int:
        import diffusers

        cls = getattr(diffusers, cls_name)
        return count_meta(lambda: cls.from_config(read_component_config(folder)))
    return count


def load_vae_decoder(cls_name: str, facts: Callable[[Any], dict[str, Any]]) -> Callable[[Path, torch.dtype],
                                                                                         Traceable]:
    """A loader of the VAE decoder of diffusers class `cls_name`; `facts(config)` says what its input is."""
    def load(folder: Path, dtype: torch.dtype) -> Traceable:
        import diffusers

        vae = quiet_from_pretrained(getattr(diffusers, cls_name), folder, dtype)
        gen = torch.Generator().manual_seed(0)
        latents = torch.randn(2, vae.config.latent_channels, 6, 5, generator=gen).to(dtype)
        return Traceable(VaeDecoderGraph(vae), {"latent_sample": latents},
                         {"latent_sample": {0: "batch", 2: "latent_height", 3: "latent_width"}}, ["sample"],
                         facts(vae.config))
    return load


def nbytes(params: int, dtype: torch.dtype) -> int:
    return params * torch.empty((), dtype=dtype).element_size()


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"
