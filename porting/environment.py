"""What a bug report needs to know about this machine: versions, builds, extras, devices, folders (`port env`).

Versions are read from the installed packages' metadata (nothing is imported for them); torch is imported once,
for its CUDA / ROCm build and the devices it sees. Every probe that fails says so in its value; none stops the run.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any

import porting

# the extras of pyproject.toml and the modules that show each is installed
EXTRAS: dict[str, tuple[str, ...]] = {
    "metrics": ("torchmetrics",),
    "quant": ("gguf",),
    "onnx": ("onnx", "onnxscript", "onnxruntime"),
    "lora": ("peft",),
    "ray": ("ray",),
    "charts": ("matplotlib",),
    "npu": ("torch_npu",),
}
PACKAGES = ("torch", "torch_npu", "diffusers", "transformers", "accelerate", "safetensors", "huggingface_hub",
            "onnxruntime", "onnx", "peft", "gguf", "torchmetrics", "ray", "matplotlib")
_DISTRIBUTIONS = {"torch_npu": "torch-npu", "huggingface_hub": "huggingface-hub"}
VISIBLE_ENV = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES",
               "ZE_AFFINITY_MASK")


def version() -> str:
    return porting.__version__


def package_version(name: str) -> str | None:
    """The installed version of `name` (its distribution's metadata), or None when it is not installed."""
    for dist in (_DISTRIBUTIONS.get(name, name), name):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def extras() -> dict[str, bool]:
    """Extra name -> whether every module it brings is importable here (found, not imported)."""
    def found(module: str) -> bool:
        try:
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    return {name: all(found(m) for m in modules) for name, modules in EXTRAS.items()}


def _torch_facts() -> dict[str, Any]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken torch install is what a bug report must say
        return {"torch_error": f"{type(e).__name__}: {e}"}
    facts: dict[str, Any] = {"cuda_build": torch.version.cuda, "rocm_build": getattr(torch.version, "hip", None)}
    devices: list[dict[str, Any]] = [{"device": "cpu", "name": platform.processor() or platform.machine(),
                                      "cores": os.cpu_count()}]
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                devices.append({"device": f"cuda:{i}", "name": props.name,
                                "memory_gib": round(props.total_memory / 2**30, 1)})
    except Exception as e:  # noqa: BLE001 - a broken driver
        devices.append({"device": "cuda", "error": f"{type(e).__name__}: {e}"})
    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            for i in range(torch.npu.device_count()):  # type: ignore[attr-defined]
                devices.append({"device": f"npu:{i}", "name": torch.npu.get_device_name(i)})  # type: ignore
        except Exception as e:  # noqa: BLE001 - a broken CANN install raises many kinds of errors
            devices.append({"device": "npu", "error": f"{type(e).__name__}: {e}"})
    try:
        if hasattr(torch, "xpu") and torch.xpu.is_available():
            devices.extend({"device": f"xpu:{i}"} for i in range(torch.xpu.device_count()))
        if torch.backends.mps.is_available():
            devices.append({"device": "mps"})
    except Exception:  # noqa: BLE001 - absent backends
        pass
    facts["devices"] = devices
    return facts


def folders() -> dict[str, str]:
    """The folders flux-port reads and writes outside the ones a command names: `state` (the key that seals output
    records, docs/outputs.md), `workspace` (where `port fetch RECIPE` puts a recipe), and the hubs' caches."""
    from porting.hub.workspace import workspace_root
    from porting.ownership import state_folder

    hf_home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    return {
        "state": str(state_folder()),
        "workspace": str(workspace_root().absolute()),
        "hf_cache": os.environ.get("HF_HUB_CACHE") or str(hf_home / "hub"),
        "modelscope_cache": os.environ.get("MODELSCOPE_CACHE") or str(Path.home() / ".cache" / "modelscope"),
    }


def environment() -> dict[str, Any]:
    """Everything `port env` prints, as one JSON-ready document."""
    doc: dict[str, Any] = {
        "flux_port": version(),
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {name: package_version(name) for name in PACKAGES},
        "extras": extras(),
    }
    doc.update(_torch_facts())
    doc["visible_devices_env"] = {k: os.environ[k] for k in VISIBLE_ENV if k in os.environ}
    doc["folders"] = folders()
    return doc
