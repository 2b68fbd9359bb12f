"""Components built from their config with hollow weights: what the streamed exports trace (porting/export/
streamed.py). Inside `hollow_loading(dtype)`, `onnx_components.quiet_from_pretrained` calls `hollow_pretrained`
instead of reading the weights. Imports nothing of porting.export, so the families' loaders can use it."""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from typing import Any, Iterator

import torch

_HOLLOW: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("flux_port_hollow", default=None)
TIES = "_flux_port_tied_names"  # attribute set on a hollow module: each parameter's other names (tied weights)


def hollow_dtype() -> torch.dtype | None:
    """The dtype of a hollow build in progress (inside `hollow_loading`), else None."""
    return _HOLLOW.get()


@contextlib.contextmanager
def hollow_loading(dtype: torch.dtype) -> Iterator[None]:
    """Within it, `onnx_components.quiet_from_pretrained` builds hollow modules in `dtype` instead of loading."""
    token = _HOLLOW.set(dtype)
    try:
        yield
    finally:
        _HOLLOW.reset(token)


def hollow_pretrained(cls: Any, folder: Path, dtype: torch.dtype) -> Any:
    """`cls` built from `folder`'s config: parameters zero-stride views in `dtype` (float32 where the class keeps
    modules in float32, as `from_pretrained` does), buffers computed on the CPU; tied names recorded (TIES)."""
    import warnings

    from porting.skeleton import diffusers_skeleton, empty_weights

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


