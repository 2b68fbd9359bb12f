"""Weight differences of adapter modules, in float32, and their shapes from headers alone.

LoRA: scale * B @ A with scale = alpha / rank (alpha absent: 1, i.e. alpha = rank; peft metadata may give
lora_alpha / r). LoKr: kron(w1, w2), each factor multiplied out first when stored as a / b halves, times
alpha / rank where rank is that of the factored half (w2's if both are; no scaling when neither is). LoHa:
(w1_a @ w1_b) * (w2_a @ w2_b) * alpha / rank(w1_b). ComfyUI `.diff`: the difference itself.
"""

from __future__ import annotations

import torch

from porting.errors import InputError
from porting.finite import NotFinite, check_tensor
from porting.inputs.adapter_keys import Adapter, ModuleAdapter

Shape = tuple[int, ...]


def _shape(adapter: Adapter, m: ModuleAdapter, role: str) -> Shape:
    return adapter.ckpt.tensors[m.keys[role]].shape


def rank(adapter: Adapter, m: ModuleAdapter) -> int | None:
    """The rank that alpha divides (None: the module is not low-rank, no alpha scaling)."""
    if m.kind == "lora":
        return _shape(adapter, m, "down")[0]
    if m.kind == "loha":
        return _shape(adapter, m, "w1_b")[0]
    if m.kind == "lokr":
        if "w2_b" in m.keys:
            return _shape(adapter, m, "w2_b")[0]
        if "w1_b" in m.keys:
            return _shape(adapter, m, "w1_b")[0]
    return None


def scale(adapter: Adapter, m: ModuleAdapter) -> float:
    """The factor the product of the factors is multiplied by (alpha / rank, or the peft metadata's)."""
    r = rank(adapter, m)
    if m.kind == "lora" and m.alpha is None and adapter.metadata_scale is not None:
        return adapter.metadata_scale
    if r is None or m.alpha is None:
        return 1.0
    return m.alpha / r


FLOAT32_MAX = 3.4028234663852886e38


def multiplier(adapter: Adapter, m: ModuleAdapter, strength: float = 1.0) -> float:
    """strength x scale, the number the module's product is multiplied by; it must be a float32 number."""
    s = strength * scale(adapter, m)
    if not abs(s) <= FLOAT32_MAX:  # NaN fails too
        raise NotFinite(f"{adapter.path}: strength {strength:g} x scale {scale(adapter, m):g} for {m.param} is {s:g}, "
                        "beyond float32's range; the delta would be infinite. Nothing was written.",
                        hint="Lower the strength.")
    return s


def _factor_shape(adapter: Adapter, m: ModuleAdapter, name: str) -> Shape:
    if name in m.keys:
        return _shape(adapter, m, name)
    return (_shape(adapter, m, name + "_a")[0], _shape(adapter, m, name + "_b")[1])


def delta_shape(adapter: Adapter, m: ModuleAdapter) -> Shape:
    """Shape of the parameter this module adapts, from the factor shapes (headers only)."""
    if m.kind == "lora":
        down, up = _shape(adapter, m, "down"), _shape(adapter, m, "up")
        if len(down) != 2 or len(up) != 2 or up[1] != down[0]:
            raise InputError(f"{adapter.path}: LoRA factors of {m.param} do not chain: up {list(up)}, "
                             f"down {list(down)} (expected [out, r] and [r, in]).")
        return (up[0], down[1])
    if m.kind == "lokr":
        (a, b), (c, d) = _factor_shape(adapter, m, "w1"), _factor_shape(adapter, m, "w2")
        return (a * c, b * d)
    if m.kind == "loha":
        one = (_shape(adapter, m, "w1_a")[0], _shape(adapter, m, "w1_b")[1])
        two = (_shape(adapter, m, "w2_a")[0], _shape(adapter, m, "w2_b")[1])
        if one != two:
            raise InputError(f"{adapter.path}: LoHa halves of {m.param} disagree: {list(one)} vs {list(two)}.")
        return one
    return _shape(adapter, m, "diff" if "diff" in m.keys else "diff_b")


def read32(adapter: Adapter, m: ModuleAdapter, role: str) -> torch.Tensor:
    """One factor in float32, refused if a value is NaN or infinite (checked as it is read, once per use)."""
    t = adapter.ckpt.read(m.keys[role]).to(torch.float32)
    check_tensor(t, f"adapter factor {m.keys[role]!r}", adapter.path,
                 hint="The adapter is damaged or was saved from a diverged training run; use another checkpoint.")
    return t


def factor(adapter: Adapter, m: ModuleAdapter, name: str) -> torch.Tensor:
    """A LoKr factor, multiplied out when stored as a / b halves."""
    if name in m.keys:
        return read32(adapter, m, name)
    return read32(adapter, m, name + "_a") @ read32(adapter, m, name + "_b")


def delta(adapter: Adapter, m: ModuleAdapter, strength: float = 1.0) -> torch.Tensor:
    """strength * the module's weight difference, float32, shaped like the parameter."""
    s = multiplier(adapter, m, strength)
    if m.kind == "lora":
        out = read32(adapter, m, "up") @ read32(adapter, m, "down")
    elif m.kind == "lokr":
        out = torch.kron(factor(adapter, m, "w1"), factor(adapter, m, "w2"))
    elif m.kind == "loha":
        out = ((read32(adapter, m, "w1_a") @ read32(adapter, m, "w1_b"))
               * (read32(adapter, m, "w2_a") @ read32(adapter, m, "w2_b")))
    else:
        out = read32(adapter, m, "diff" if "diff" in m.keys else "diff_b")
    if s != 1.0:
        out.mul_(s)
    if tuple(out.shape) != delta_shape(adapter, m):
        raise InputError(f"{adapter.path}: {m.param}: difference came out {list(out.shape)}.")
    return out

