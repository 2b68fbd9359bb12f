"""What runs as a pipeline's transformer: a diffusers transformer folder, or a Nunchaku SVDQuant file kept packed.

`transformer_source(path)` tells them apart once (header only); everything `pipeload` does with a transformer
(its config, its class, loading it, its weights identity, its memory) asks the returned object, so an SVDQuant
file goes wherever a transformer folder goes. An SVDQuant transformer is a `.safetensors` file, or a folder holding
exactly one (or Nunchaku's older FLUX.1 pair `transformer_blocks.safetensors` + `unquantized_layers.safetensors`),
with or without a config.json next to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from porting._files import read_config
from porting.errors import InputError

SVDQ_COMPUTES = ("w4a4", "w4a16")


@dataclass(frozen=True)
class TransformerSource:
    path: Path
    svdq: bool = False
    _config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    label: str = ""  # e.g. "SVDQuant int4, rank 32, group 64" (empty for a diffusers folder)
    family: str = ""
    source: Any = field(default=None, compare=False, repr=False)  # the opened input (porting.inputs.Source), once

    def config(self) -> dict[str, Any]:
        if self.svdq:
            return dict(self._config)
        return read_config(self.path / "config.json", "a transformer config")

    def model_class(self) -> Any:
        """The diffusers class, one a registered family converts."""
        import diffusers

        from porting.families import families

        known = {f.diffusers_class for f in families()}
        if self.svdq:
            from porting.runtime.svdq_model import model_class

            return model_class(self.family, self._config)
        name = self.config().get("_class_name")
        if name not in known:
            raise InputError(f"{self.path}: config.json _class_name is {name!r}; flux-port runs "
                             f"{', '.join(sorted(known))}.", hint="Swap in a transformer port convert wrote.")
        return getattr(diffusers, str(name))

    def load(self, dtype: Any, svdq_compute: str = "w4a4") -> Any:
        """The model on the CPU in `dtype`; an SVDQuant file's linears stay packed and compute as `svdq_compute`."""
        if self.svdq:
            from porting.runtime.svdq_model import load_svdq_transformer

            return load_svdq_transformer(self.opened(), dtype, svdq_compute)
        return self.model_class().from_pretrained(self.path, torch_dtype=dtype)

    def opened(self) -> Any:
        """The input opened once (headers), shared by load, identity and size."""
        if self.source is not None:
            return self.source
        from porting.inputs import open_source

        source = open_source(self.path, kind="weights")
        object.__setattr__(self, "source", source)
        return source

    def weights_sha256(self) -> str:
        """The weights identity. An SVDQuant file's is taken over its stored (packed) tensors: what runs."""
        if not self.svdq:
            return self.opened().weights_sha256
        ckpt = self.opened().view
        from porting.known_digests import known_weights
        from porting.tensors.identity import WeightsHasher
        from porting.tensors.reader import read_stored

        known = known_weights(ckpt.files)
        if known is not None:  # as flux-port's writer left it
            return known
        hasher = WeightsHasher()
        for key, info in (ckpt.stored or ckpt.tensors).items():
            hasher.update(key, read_stored(info), info.dtype)
        return hasher.hexdigest()

    def stored_bytes(self) -> int:
        """Bytes of the tensors as stored (an SVDQuant file's packed size)."""
        ckpt = self.opened().view
        return sum(t.nbytes for t in (ckpt.stored or ckpt.tensors).values())


def _svdq_config(path: Path, source: Any) -> dict[str, Any]:
    config = source.view.config
    if not config:
        raise InputError(f"{path}: an SVDQuant file without a model config (header metadata 'config', or a "
                         "config.json next to it); its sizes cannot be known.",
                         hint="Put the diffusers config.json of the model in a folder with the file.")
    return dict(config)


def _may_be_svdq_folder(path: Path) -> bool:
    if _lite_folder(path):
        return True
    names = [p.name for p in path.glob("*.safetensors")]
    return bool(names) and not any(n.startswith("diffusion_pytorch_model") for n in names) \
        and not any(path.glob("*.safetensors.index.json"))


def _lite_folder(path: Path) -> bool:
    """A diffusers folder in diffusers' own Nunchaku layout (its weights packed: run as an SVDQuant source)."""
    import json

    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(qc, dict) and qc.get("quant_method") == "nunchaku_lite"


def transformer_source(path: str | Path) -> TransformerSource:
    """A transformer folder (config.json + diffusers weights) or an SVDQuant file (or a folder holding one)."""
    path = Path(path)
    if path.is_file() or (path.is_dir() and _may_be_svdq_folder(path)):
        from porting.inputs import open_source
        from porting.tensors.quant.svdq.reader import svdq_info

        source = open_source(path, kind="weights")
        info = svdq_info(source.view)
        if info is not None:
            return TransformerSource(path, True, _svdq_config(path, source), info.label, info.family, source)
        if path.is_file():
            raise InputError(f"{path}: neither a diffusers transformer folder nor a Nunchaku SVDQuant file.",
                             hint="Point at a converted transformer folder (port convert ... --out DIR) or an "
                                  "SVDQuant .safetensors file.")
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: no config.json; not a diffusers transformer folder.",
                         hint="Point at a converted transformer folder (port convert ... --out DIR) or an SVDQuant "
                              ".safetensors file.")
    return TransformerSource(path)


__all__ = ["SVDQ_COMPUTES", "TransformerSource", "transformer_source"]
