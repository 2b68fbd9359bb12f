"""Loading a pipeline folder for compare and bench: optional transformer swap, optional text encoder, offloading,
and the weights identity of the transformer that actually runs (what publish matches tables against)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from porting._files import read_config
from porting.errors import InputError, PortError
from porting.progress import debug

from .run_options import OFFLOADS  # noqa: F401  (pipeload.OFFLOADS: the modes it loads)
from .transformer_source import transformer_source


def transformer_folder(folder: Path, transformer: Path | None) -> Path:
    """The transformer that runs: the swap if given (a transformer folder, or an SVDQuant file or a folder holding
    one), else the pipeline folder's own transformer/."""
    path = transformer if transformer is not None else folder / "transformer"
    return transformer_source(path).path


def transformer_config(transformer: Path) -> dict[str, Any]:
    """The config of a transformer folder or SVDQuant file."""
    return transformer_source(transformer).config()


# what the rest of the pipeline (text encoder, VAE) fixes about the transformer it can run
PIPELINE_GEOMETRY = ("joint_attention_dim", "pooled_projection_dim", "in_channels", "out_channels", "guidance_embeds")


def check_swap_fits(folder: Path, transformer: Path, option: str = "--transformer") -> None:
    """A transformer swapped into `folder`'s pipeline takes the same text features and latents as the folder's own
    (joint_attention_dim, in_channels, ...): another geometry is refused by name, before anything loads. `option`:
    what the message names (convert's `--calibrate` names the pipeline folder, generate's `--transformer` the swap)."""
    own_path = Path(folder) / "transformer" / "config.json"
    if not own_path.is_file():
        return
    own = read_config(own_path, "the pipeline's transformer config")
    swap = transformer_config(transformer)
    for field in PIPELINE_GEOMETRY:
        if own.get(field) != swap.get(field):
            if option != "--transformer":
                raise InputError(f"{option} {folder}: its pipeline runs a transformer with {field} "
                                 f"{own.get(field)!r}, {transformer} has {swap.get(field)!r}; its text encoder and "
                                 "VAE cannot feed that one.", hint=f"Give {option} a pipeline of the same model "
                                                                   "family and size.")
            raise InputError(f"--transformer {transformer}: {field} is {swap.get(field)!r}, the pipeline {folder} "
                             f"runs a transformer with {field} {own.get(field)!r}; its text encoder and VAE cannot "
                             "feed this one.", hint="Swap in a transformer of the same model family and size.")


def transformer_class(transformer: Path) -> Any:
    """The diffusers class of a transformer folder (its config's `_class_name`, if a registered family has it) or of
    an SVDQuant file (its family's)."""
    return transformer_source(transformer).model_class()


def text_components(folder: Path) -> list[str]:
    """The text encoders and tokenizers model_index.json lists (text_encoder, text_encoder_2, tokenizer, ...)."""
    from porting._files import read_json_object

    index = read_json_object(Path(folder) / "model_index.json", "a diffusers pipeline folder has one at its root")
    return sorted(k for k in index if k.startswith(("text_encoder", "tokenizer")))


def weights_sha256(transformer: Path) -> str:
    """The weights identity convert and publish record, recomputed from the files (an SVDQuant file's: over its
    packed tensors)."""
    return transformer_source(transformer).weights_sha256()


def load(folder: Path, device: torch.device, dtype: torch.dtype, *, transformer: Path | None = None,
         text_encoder: bool = True, offload: str = "none", svdq_compute: str = "w4a4",
         text_encoder_file: Any | None = None) -> Any:
    """The folder's pipeline in `dtype`, on `device` or offloaded to it, with its progress bars off.

    `transformer` replaces the folder's transformer (its class from its config.json, one a registered family
    converts); `text_encoder=False` leaves every text encoder and tokenizer unloaded (the caller passes prompt
    embeddings). An SVDQuant `transformer` keeps its linears packed and computes them as `svdq_compute` (w4a4: the
    Nunchaku kernel's arithmetic; w4a16: the dequantized weights). `text_encoder_file`: a 4-bit text encoder opened
    by `text_encoder_swap.open_swap`, run packed in its slot instead of the folder's.
    """
    from diffusers import DiffusionPipeline

    if offload not in OFFLOADS:
        raise PortError(f"offload mode {offload!r}: choose one of {', '.join(OFFLOADS)}.")
    overrides: dict[str, Any] = {}
    with warnings.catch_warnings():  # diffusers 0.42 renamed torch_dtype to dtype; older ones know torch_dtype only
        warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
        if transformer is not None:
            overrides["transformer"] = transformer_source(transformer).load(dtype, svdq_compute)
        if not text_encoder:
            overrides.update({name: None for name in text_components(folder)})
        elif text_encoder_file is not None:
            from .text_encoder_swap import load_swap

            slot, packed = load_swap(text_encoder_file, torch.device("cpu"), dtype)
            overrides[slot] = packed
        pipe = DiffusionPipeline.from_pretrained(folder, local_files_only=True, torch_dtype=dtype, **overrides)
    if offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    elif offload == "group":
        # leaf-level groups overlap the next layer's transfer with compute on CUDA streams
        pipe.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                  offload_type="leaf_level", use_stream=device.type == "cuda")
    else:
        pipe.to(device)
    pipe.set_progress_bar_config(disable=not debug())  # flux-port prints its own progress
    return pipe


def check_memory(verb: str, folder: Path, device: torch.device, dtype: str, width: int, height: int, *,
                 transformer: Path | None = None, text_encoder: bool = True, extra_tokens: int = 0) -> int:
    """Refuse (exit 2, before loading anything) a pipeline run whose weights and activations would not fit in the
    host's memory (porting.resources)."""

    from porting.resources import check_component_configs, check_pipeline_memory

    folder = Path(folder)
    source = transformer_source(transformer) if transformer is not None else None
    tr = source.path if source is not None else folder / "transformer"
    components = {"vae": folder / "vae"}
    packed = 0
    if source is not None and source.svdq:  # held packed: its stored bytes, not parameters times the dtype
        packed = source.stored_bytes()
    else:
        components["transformer"] = tr
    if text_encoder:  # every text encoder: FLUX.1 has CLIP and T5 (text_encoder_2)
        components.update({p.name: p for p in sorted(folder.glob("text_encoder*"))})
    if source is not None:
        config = source.config()
    else:
        config = read_config(tr / "config.json", "the transformer's config") if (tr / "config.json").is_file() else {}
    check_component_configs({k: v for k, v in components.items() if v.is_dir()})  # before from_pretrained builds
    return check_pipeline_memory(verb, {k: v for k, v in components.items() if v.is_dir()}, config, width=width,
                                 height=height, dtype=dtype, on_cpu=device.type == "cpu", extra_tokens=extra_tokens,
                                 extra_weight_bytes=packed)


def initial_latents(pipe: Any, width: int, height: int, seed: int) -> torch.Tensor:
    """The starting noise, drawn in float32 from a CPU generator so every device and dtype starts from the same
    numbers (the pipeline casts it to its own dtype); shape (1, in_channels, H / 16, W / 16) as the FLUX.2 pipelines
    take it, or the same numbers as (1, patches, in_channels) for a pipeline whose variant takes packed latents."""
    from porting.families import pipeline_variants

    from .variants import matching_variants

    factor = getattr(pipe, "vae_scale_factor", 8) * 2
    channels = int(pipe.transformer.config.in_channels)
    generator = torch.Generator("cpu").manual_seed(seed)
    noise = torch.randn((1, channels, height // factor, width // factor), generator=generator, dtype=torch.float32)
    names = matching_variants({"_class_name": type(pipe).__name__})
    if names and pipeline_variants()[names[0]][1].packed_latents:
        return noise.flatten(2).transpose(1, 2).contiguous()
    return noise


def check_size(pipe: Any, width: int, height: int) -> None:
    multiple = getattr(pipe, "vae_scale_factor", 8) * 2
    if width % multiple or height % multiple:
        raise PortError(f"--size {width}x{height}: both sides must be multiples of {multiple} for this pipeline.",
                        hint=f"e.g. --size {max(multiple, width // multiple * multiple)}")


def release_memory(device: torch.device) -> None:
    """Collect the pipeline the caller just dropped (`del pipe`) and give its device memory back."""
    import gc

    gc.collect()
    acc = getattr(torch, device.type, None) if device.type != "cpu" else None
    if acc is not None and hasattr(acc, "empty_cache"):
        acc.empty_cache()
