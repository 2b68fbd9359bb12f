"""A diffusers transformer built from a Nunchaku SVDQuant file, its quantized linears kept packed (`SvdqLinear`).

The model is made on the meta device from the file's config, its 16-bit tensors (norms, embedders, modulation, final
layer) are read one at a time in `dtype`, and every linear the file quantizes becomes an `SvdqLinear` built from the
packed parts, layer by layer: the bf16 weights of the quantized layers never exist in memory at once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from porting.errors import InputError
from porting.skeleton import diffusers_skeleton
from porting.tensors.quant.svdq.decode import SvdqDecoder
from porting.tensors.quant.svdq.reader import svdq_info

from .svdq_linear import COMPUTES, SvdqLinear


def model_class(family: str, config: dict[str, Any]) -> Any:
    """The diffusers class the file's family converts to (the config's `_class_name` must agree)."""
    import diffusers

    from porting.families import families

    by_name = {f.name: f.diffusers_class for f in families()}
    name = by_name.get(family)
    given = config.get("_class_name")
    if name is None or (given and given != name and not str(given).startswith("Nunchaku")):
        raise InputError(f"SVDQuant file of family {family!r} with config class {given!r}: flux-port runs "
                         f"{', '.join(sorted(by_name.values()))}.")
    return getattr(diffusers, name)


def load_svdq_transformer(path: Any, dtype: torch.dtype, compute: str = "w4a4") -> nn.Module:
    """The transformer of an SVDQuant file (or a folder holding one; or its opened `porting.inputs.Source`), on the
    CPU, its 16-bit tensors in `dtype`."""
    from porting.inputs import as_source

    if compute not in COMPUTES:
        raise InputError(f"--svdq-compute {compute!r}: choose one of {', '.join(COMPUTES)}.")
    source = as_source(path, kind="weights")
    path = source.path
    ckpt = source.view
    info = svdq_info(ckpt)
    if info is None:
        raise InputError(f"{path}: not a Nunchaku SVDQuant file.")
    config = {k: v for k, v in (ckpt.config or {}).items() if k != "quantization_config"}  # the layers say it
    if not config:
        raise InputError(f"{path}: an SVDQuant file without a model config (header metadata 'config', or a "
                         "config.json next to it); the transformer's sizes cannot be known.",
                         hint="Put the diffusers config.json of the model next to the file.")
    cls = model_class(info.family, config)
    model = diffusers_skeleton(cls, config)
    decoder = SvdqDecoder(info)
    for key, target in info.targets.items():
        if target.role != "weight":
            continue
        module = key[: -len(".weight")]
        old = model.get_submodule(module)
        if not isinstance(old, nn.Linear) or (old.out_features, old.in_features) != target.shape:
            raise InputError(f"{path}: {key} {list(target.shape)} does not fit the model's {module} "
                             f"({old!r}); the file's config and its layers disagree.")
        model.set_submodule(module, SvdqLinear.from_target(target, info.targets.get(module + ".bias"), decoder,
                                                           compute))
    state = {key: ckpt.read(key, dtype=dtype) for key, t in ckpt.tensors.items() if not t.computed}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise InputError(f"{path}: tensor {result.unexpected_keys[0]!r} has no place in {cls.__name__} "
                         f"({len(result.unexpected_keys)} such).")
    missing = [k for k in result.missing_keys]
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing or meta:
        raise InputError(f"{path}: {cls.__name__} needs {(missing or meta)[0]!r}, which the file does not hold "
                         f"({len(set(missing) | set(meta))} such).", hint="The file is incomplete.")
    return model.eval()


def set_compute(model: nn.Module, compute: str) -> None:
    """Switch every SvdqLinear of `model` to "w4a4" or "w4a16"."""
    if compute not in COMPUTES:
        raise ValueError(f"compute {compute!r}: one of {', '.join(COMPUTES)}")
    for m in model.modules():
        if isinstance(m, SvdqLinear):
            m.compute = compute


def packed_bytes(model: nn.Module) -> int:
    """Bytes of the packed parts of every SvdqLinear of `model`."""
    return sum(m.packed_bytes() for m in model.modules() if isinstance(m, SvdqLinear))


__all__ = ["load_svdq_transformer", "model_class", "set_compute", "packed_bytes"]
