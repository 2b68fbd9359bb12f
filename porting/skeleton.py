"""A model's skeleton without memory: every parameter on the meta device, every buffer computed on the CPU.

Every place that builds a model only for its shapes or parameter count, or to fill it later, builds it here. This is
accelerate's `init_empty_weights(include_buffers=False)`, which patches parameter registration, not
`with torch.device("meta")`, which switches torch's default device: a module that Python first imports inside that
block makes its module-level tensors on the meta device for the rest of the process (diffusers'
`quantizers/bfl/utils.py` lookup table, after which every BFL-scheme nvfp4 dequantization fails). accelerate's
`include_buffers=True` is that same default-device switch, and its default reads ACCELERATE_INIT_INCLUDE_BUFFERS,
so it is passed explicitly. Buffers stay real: the models built here hold a few hundred bytes of them (rotary
frequencies, batch-norm statistics), and a skeleton at klein-9B or Qwen3-8B size adds tens of MB to the peak RSS
(tests/test_skeleton.py).

The patch is process-wide while the block runs: a module built in another thread at that moment gets meta
parameters too. flux-port builds models on one thread (its threads only hash files).

A skeleton is given memory by `materialise`, never by `module.to_empty(device=...)`: to_empty replaces every tensor,
buffers included, by uninitialised memory, so the rotary tables and batch-norm statistics computed at build time
would be garbage. `release` hands a materialised module's parameters back to the meta device and keeps its buffers.

A hollow model (`hollow_pretrained`) is a skeleton whose parameters are zero-stride views instead of meta tensors:
what the streamed ONNX exports trace. Inside `hollow_loading(dtype)`, `families/export_spec.py: quiet_from_pretrained`
builds one instead of reading the weights.
"""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

if TYPE_CHECKING:
    import torch


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Within it, modules get their parameters on the meta device (no memory); buffers and any other tensor are made
    where they would be without it."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


def diffusers_skeleton(cls: Any, config: Mapping[str, Any]) -> Any:
    """`cls.from_config(config)` (a diffusers model class; `_`-prefixed keys dropped) built in `empty_weights()`,
    with diffusers' notices about unused config keys silenced."""
    import logging
    import warnings

    clean = {k: v for k, v in config.items() if not k.startswith("_")}
    log = logging.getLogger("diffusers")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), empty_weights():
            warnings.simplefilter("ignore")
            return cls.from_config(clean)
    finally:
        log.setLevel(level)


def materialise(module: torch.nn.Module, device: torch.device | str,
                dtype: torch.dtype | None = None) -> torch.nn.Module:
    """`module` in place, returned: each tensor on the meta device allocated on `device` (uninitialised; floating ones
    in `dtype` when given), each real one moved there (floating ones cast to `dtype`, as `module.to(device, dtype)`
    casts them) with its values. A meta parameter is allocated once, at its final dtype; a parameter or buffer shared
    by several modules (tied weights) stays one tensor."""
    import torch

    done: dict[int, torch.Tensor] = {}

    def place(t: torch.Tensor) -> torch.Tensor:
        if id(t) in done:
            return done[id(t)]
        want = dtype if dtype is not None and t.is_floating_point() else t.dtype
        new = torch.empty(t.shape, dtype=want, device=device) if t.is_meta else t.to(device=device, dtype=want)
        if isinstance(t, torch.nn.Parameter) and new is not t:
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        done[id(t)] = new
        return new

    with torch.no_grad():
        for m in module.modules():
            for tensors in (m._parameters, m._buffers):
                for name, t in list(tensors.items()):
                    if t is not None:
                        tensors[name] = place(t)
    return module


def release(module: torch.nn.Module) -> torch.nn.Module:
    """`module` in place, returned: every parameter back on the meta device (its memory freed once nothing else holds
    it); buffers kept where they are, with their values, for the next `materialise`."""
    import torch

    done: dict[int, torch.nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and not p.is_meta:
                if id(p) not in done:
                    done[id(p)] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
                m._parameters[name] = done[id(p)]
    return module


# A hollow model: what the streamed exports trace (porting/export/streamed.py)
_HOLLOW: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("flux_port_hollow", default=None)
TIES = "_flux_port_tied_names"  # attribute set on a hollow module: each parameter's other names (tied weights)


def hollow_dtype() -> torch.dtype | None:
    """The dtype of a hollow build in progress (inside `hollow_loading`), else None."""
    return _HOLLOW.get()


@contextlib.contextmanager
def hollow_loading(dtype: torch.dtype) -> Iterator[None]:
    """Within it, `export_spec.quiet_from_pretrained` builds hollow modules in `dtype` instead of loading."""
    token = _HOLLOW.set(dtype)
    try:
        yield
    finally:
        _HOLLOW.reset(token)


def hollow_pretrained(cls: Any, folder: Path, dtype: torch.dtype) -> Any:
    """`cls` built from `folder`'s config: parameters zero-stride views in `dtype` (float32 where the class keeps
    modules in float32, as `from_pretrained` does), buffers computed on the CPU; tied names recorded (TIES)."""
    import warnings

    import torch

    if hasattr(cls, "load_config"):  # diffusers
        from porting._files import read_config

        model = diffusers_skeleton(cls, read_config(Path(folder) / "config.json", "a component config"))
    else:  # transformers
        from transformers import AutoConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            with empty_weights():
                model = cls.from_config(config) if hasattr(cls, "from_config") else cls._from_config(config)
    keep32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tied = {n: [m for m in group if m != n] for group in names.values() if len(group) > 1 for n in group}
    # what the class declares tied (transformers 5: {target: source}); a meta build does not tie them itself
    declared = getattr(model, "_tied_weights_keys", None)
    for target, src in (declared.items() if isinstance(declared, dict) else ()):
        tied.setdefault(target, []).append(src)
        tied.setdefault(src, []).append(target)
    for module_name, m in model.named_modules():
        for name, p in list(m.named_parameters(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            want = torch.float32 if any(k in full.split(".") for k in keep32) else dtype
            want = want if p.is_floating_point() else p.dtype
            setattr(m, name, torch.nn.Parameter(torch.zeros((), dtype=want).expand(p.shape), requires_grad=False))
    setattr(model, TIES, tied)
    return model.eval().requires_grad_(False)
