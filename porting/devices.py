"""Device strings (`cpu`, `cuda[:N]`, `npu[:N]`, `mps`, `xpu[:N]`) parsed by flux-port itself.

Stock PyTorch rejects `torch.device("npu:0")` until `torch_npu` registers the backend, so the string is parsed
first and the backend imported lazily; torch itself is imported by the functions that need it, so that a device
string is checked (parse_device) before torch is loaded.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from porting.errors import DeviceError

if TYPE_CHECKING:
    import torch

KNOWN = ("cpu", "cuda", "npu", "mps", "xpu")
VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES", "xpu": "ZE_AFFINITY_MASK"}
_PATTERN = re.compile(r"^(?P<type>[a-z]+)(?::(?P<index>\d+))?$")


@dataclass(frozen=True)
class DeviceSpec:
    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def parse_device(text: str) -> DeviceSpec:
    m = _PATTERN.match(text.strip().lower())
    if not m or m.group("type") not in KNOWN:
        raise DeviceError(f"Unknown device {text!r}.", hint="Use one of: cpu, cuda[:N], npu[:N], mps, xpu[:N].")
    kind, index = m.group("type"), m.group("index")
    if kind in ("cpu", "mps") and index not in (None, "0"):
        raise DeviceError(f"Device {text!r}: {kind} takes no index.")
    return DeviceSpec(kind, int(index) if index is not None and kind not in ("cpu", "mps") else None)


def _visible(kind: str) -> str:
    env = VISIBLE_ENV.get(kind)
    if not env:
        return ""
    return f"{env}={os.environ[env]!r}" if env in os.environ else f"{env} not set"


def _check_index(spec: DeviceSpec, count: int) -> None:
    index = spec.index or 0
    if index >= count:
        visible_env = VISIBLE_ENV.get(spec.type, "the visible devices")
        raise DeviceError(f"Device {spec} is not available: {count} {spec.type} device(s) visible "
                          f"({_visible(spec.type)}).", hint=f"Pick an index below {count} or change {visible_env}.")


def resolve_device(text: str, option: str = "--device") -> torch.device:
    """Parse, import the backend if needed, check the device exists, and return a torch.device; `option` names
    the option the text came from in the refusal."""
    import torch

    spec = parse_device(text)
    if spec.type == "cpu":
        return torch.device("cpu")
    if spec.type == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            raise DeviceError(
                f"{option} {spec} needs torch_npu, which is not installed (torch {torch.__version__}; "
                f"{_visible('npu')}).",
                hint='Install the Ascend backend: pip install "flux-port[npu]" (torch_npu must match your torch and '
                     'CANN versions), then source the CANN set_env.sh.')
        try:
            importlib.import_module("torch_npu")
            count = torch.npu.device_count()  # type: ignore[attr-defined]
        except Exception as e:  # a broken CANN install raises many kinds of errors
            raise DeviceError(f"torch_npu is installed but failed to initialise: {e}",
                              hint="Check the CANN toolkit (source set_env.sh) and the driver.") from e
        _check_index(spec, count)
    elif spec.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"{option} {spec}: no CUDA device available (torch {torch.__version__}, "
                              f"built for CUDA {torch.version.cuda}; {_visible('cuda')}).",
                              hint=f"Install a CUDA build of torch, or use {option} cpu.")
        _check_index(spec, count)
    elif spec.type == "xpu":
        count = torch.xpu.device_count() if hasattr(torch, "xpu") and torch.xpu.is_available() else 0
        if count == 0:
            raise DeviceError(f"{option} {spec}: no XPU device available ({_visible('xpu')}).")
        _check_index(spec, count)
    elif spec.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"{option} mps: the MPS backend is not available on this machine.")
    return torch.device(str(spec))


def free_memory(device: torch.device) -> int | None:
    """Free bytes on an accelerator that is present (resolve_device first): torch.cuda.mem_get_info, or torch_npu's
    torch.npu.mem_get_info; None for the CPU and where the backend cannot say."""
    import torch

    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "npu":
            return int(torch.npu.mem_get_info(device)[0])  # type: ignore[attr-defined]
        if device.type == "xpu" and hasattr(torch.xpu, "mem_get_info"):
            return int(torch.xpu.mem_get_info(device)[0])
    except Exception:  # a backend without the query, or a driver that fails it: nothing to check against
        return None
    return None


def npu_importable() -> bool:
    """Whether torch_npu imports here (the probe tests replace)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        importlib.import_module("torch_npu")
        return True
    except Exception:  # a broken CANN install raises many kinds of errors
        return False


def validate_device() -> str:
    """The `--device` a hint names: a device this machine has (npu:0 only where torch_npu imports, else cuda when
    CUDA is available, else cpu)."""
    import torch

    if npu_importable():
        return "npu:0"
    try:
        if torch.cuda.is_available():
            return "cuda"
    except Exception:  # a broken driver: not a device to suggest
        pass
    return "cpu"


def device_facts(device: torch.device) -> dict[str, object]:
    """What a report must record about the device and its software (validation-practice.md 6.7)."""
    import torch

    facts: dict[str, object] = {"device": str(device), "torch": torch.__version__}
    try:
        import diffusers
        facts["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    if device.type == "npu":
        import torch_npu  # noqa: F401  (already imported by resolve_device)
        facts["torch_npu"] = getattr(torch_npu, "__version__", "?")
        facts["device_name"] = torch.npu.get_device_name(device)  # type: ignore[attr-defined]
        for env in ("ASCEND_RT_VISIBLE_DEVICES", "ACL_PRECISION_MODE"):
            facts[env] = os.environ.get(env)
    elif device.type == "cuda":
        facts["device_name"] = torch.cuda.get_device_name(device)
        facts["cuda"] = torch.version.cuda
        facts["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        facts["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    facts["rope_freqs_dtype"] = "float32" if device.type in ("npu", "mps") else "float64"
    return facts
