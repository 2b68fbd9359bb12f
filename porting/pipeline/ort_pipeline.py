"""An exported folder as a diffusers pipeline: the transformer runs in onnxruntime, the other components stay torch
(loaded from the source pipeline folder the export manifest names).

`OrtTransformer` stands in for the family's transformer inside the pipeline: it offers what the FLUX pipelines use
of their transformer (`config`, `dtype`, `cache_context`, the forward keywords) and feeds the exported graph's named
inputs, which are the diffusers forward's argument names.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch
from torch import nn

from porting._files import read_config
from porting.errors import InputError, PortError
from porting.export import identity
from porting.export.onnx import MANIFEST, find_manifest
from porting.export.ort import SessionSettings, open_session

NUMPY_DTYPES = {"tensor(float)": torch.float32, "tensor(float16)": torch.float16}


class OrtTransformer(nn.Module):
    """`dtype` is the pipeline's (its torch components'): the pipeline makes its latents in the transformer's dtype
    and hands them to the VAE, so an fp16 graph among fp32 components is fed fp16 and answers in the dtype it was
    given (an fp16 latent reaching an fp32 VAE fails at its first convolution)."""

    def __init__(self, folder: Path, config: dict[str, Any], provider: str = "CPUExecutionProvider",
                 settings: SessionSettings | None = None, file: str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.session = open_session(folder, provider, file, settings)
        self.input_names = [i.name for i in self.session.get_inputs()]
        first = self.session.get_inputs()[0]
        self.graph_dtype = NUMPY_DTYPES.get(first.type, torch.float32)
        self._dtype = dtype or self.graph_dtype
        self.config = SimpleNamespace(**config)
        self.provider = provider
        self.register_buffer("_anchor", torch.zeros((), dtype=self._dtype), persistent=False)  # .to() has a target

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    @contextlib.contextmanager
    def cache_context(self, name: str) -> Iterator[None]:
        yield

    def forward(self, hidden_states: torch.Tensor, joint_attention_kwargs: dict[str, Any] | None = None,
                return_dict: bool = False, **given: Any) -> tuple[torch.Tensor]:
        """The pipeline's keyword arguments fed by name: the graph's inputs are the diffusers forward's names, so
        whatever the family's graph takes (FLUX.1's pooled_projections, guidance where the model has it) is passed
        through; an input the graph needs and the pipeline did not pass is an error naming it."""
        if given.get("kv_cache_mode") is not None:
            raise PortError("the ONNX transformer has no KV cache; generate with the torch transformer instead.")
        given["hidden_states"] = hidden_states
        feed = {}
        for name in self.input_names:
            value = given.get(name)
            if value is None:
                raise PortError(f"the exported transformer needs {name!r}, which the pipeline did not pass.")
            value = value.to(self.graph_dtype) if value.is_floating_point() else value
            feed[name] = value.detach().cpu().contiguous().numpy()
        (out,) = self.session.run(None, feed)
        return (torch.from_numpy(out).to(hidden_states.device, hidden_states.dtype),)


def export_source(folder: Path) -> Path | None:
    """The source pipeline folder of an ONNX export folder; None when `folder` is not an export."""
    if not (Path(folder) / MANIFEST).is_file():
        return None
    root, manifest = find_manifest(folder)
    identity.check(root, manifest)
    src = manifest.get("source") or {}
    if src.get("layout") != "pipeline":
        raise InputError(f"{folder}: exported from a lone transformer folder; generating needs the text encoder, VAE "
                         "and scheduler of a pipeline.", hint="Export a published folder (port publish --out).")
    if "transformer" not in manifest.get("components", {}):
        raise InputError(f"{folder}: this export has no transformer component to run.")
    if not isinstance(src.get("folder"), str) or not src["folder"]:
        raise InputError(f"{folder / MANIFEST}: 'source.folder' is {src.get('folder')!r}; port export writes the "
                         "source pipeline's path there.", hint="The manifest is damaged or hand-edited; export again.")
    path = Path(src["folder"])
    if not (path / "model_index.json").is_file():
        raise InputError(f"{folder}: the source pipeline {path} the export names is gone; its text encoder and VAE "
                         "run in torch.", hint="Keep the source folder, or export again.")
    return path


def graph_for_size(folder: Path, size: tuple[int, int] | None) -> str | None:
    """The transformer graph of a ryzenai export with several sizes (one static graph per --size) for a square
    `size`; None for a one-graph export. A size the export has no graph for is an error naming those it has."""
    _, manifest = find_manifest(folder)
    graphs = manifest.get("components", {}).get("transformer", {}).get("graphs") or {}
    if not graphs:
        return None
    if size is not None and size[0] == size[1] and str(size[0]) in graphs:
        return Path(graphs[str(size[0])]["file"]).name
    raise PortError(f"{folder}: the ryzenai export has static graphs for {', '.join(f'{s}x{s}' for s in graphs)} "
                    f"only; --size {'x'.join(map(str, size)) if size else '(default)'} has none.",
                    hint=f"Generate with --size {next(iter(graphs))}, or export that size too.")


def exported_weights(folder: Path) -> str:
    """The sha256 of the source transformer weights the export's graph was made from, as its manifest records it."""
    root, manifest = find_manifest(folder)
    weights = (manifest.get("source") or {}).get("weights_sha256")
    if not isinstance(weights, str) or not weights:
        raise InputError(f"{root / MANIFEST}: 'source.weights_sha256' is {weights!r}; port export writes the source "
                         "transformer's weights sha256 there.", hint="The manifest is damaged or hand-edited; "
                         "export again.")
    return weights


def load_onnx_pipeline(folder: Path, dtype: torch.dtype, provider: str = "CPUExecutionProvider",
                       settings: SessionSettings | None = None, size: tuple[int, int] | None = None,
                       text_encoder: bool = True) -> Any:
    """The source pipeline with its transformer replaced by the exported graph (for a ryzenai export with several
    sizes, the graph of `size`); `text_encoder=False` leaves the text encoders and tokenizers unloaded."""
    from diffusers import DiffusionPipeline
    from diffusers.utils import logging as diffusers_logging

    from porting.pipeline.pipeload import text_components

    source = export_source(folder)
    if source is None:
        raise InputError(f"{folder}: no {MANIFEST}; not written by port export.")
    config = {k: v for k, v in read_config(source / "transformer" / "config.json", "the transformer's config")
              .items() if not k.startswith("_")}
    transformer = OrtTransformer(Path(folder) / "transformer", config, provider, settings,
                                 graph_for_size(Path(folder), size), dtype=dtype)
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # "expected <transformer class>" is the point of the seam
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch_dtype.*", category=FutureWarning)
            # diffusers refuses a non-ModelMixin object as a component at load time, so load without a
            # transformer and put the graph in its place
            dropped = {} if text_encoder else {name: None for name in text_components(source)}
            pipe = DiffusionPipeline.from_pretrained(source, transformer=None, local_files_only=True,
                                                     torch_dtype=dtype, **dropped)
            pipe.transformer = transformer
    finally:
        diffusers_logging.set_verbosity(level)
    return pipe
