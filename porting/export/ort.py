"""onnxruntime access shared by `port validate --runtime onnxruntime` and `port generate`: the optional-extra check,
provider checks that name the package to install, and sessions over an exported component folder."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from porting.errors import DeviceError, InputError, UsageError

ONNX_EXTRA_HINT = "pip install 'flux-port[onnx]'"
MODEL_FILE = "model.onnx"
# the PyPI package that brings each execution provider (the default `onnxruntime` wheel has CPU only)
PROVIDER_PACKAGES = {
    "CPUExecutionProvider": "onnxruntime",
    "CUDAExecutionProvider": "onnxruntime-gpu",
    "TensorrtExecutionProvider": "onnxruntime-gpu",
    "CANNExecutionProvider": "onnxruntime-cann",
    "VitisAIExecutionProvider": "onnxruntime-vitisai (AMD Ryzen AI software)",
    "DmlExecutionProvider": "onnxruntime-directml",
    "OpenVINOExecutionProvider": "onnxruntime-openvino",
    "CoreMLExecutionProvider": "onnxruntime (macOS wheel)",
    "QNNExecutionProvider": "onnxruntime-qnn",
}


@dataclass(frozen=True)
class SessionSettings:
    """How `port validate` and `port generate` open an onnxruntime session. `lean` (the default) bounds the host
    memory to about the weights' size: external data is mapped from the file where it is aligned (port export aligns
    every tensor of 1 MiB or more to 64 KiB), the CPU memory arena and the memory pattern planner are off, and for a
    graph with bfloat16 weights (the ryzenai bf16-cast form) constant folding is off, which would otherwise store a
    float32 copy of every `Cast(bf16 weight)` (the klein-4B step was killed at 22 GiB without it).
    `prepack=False` also turns off weight prepacking (MLAS' packed copy of constant MatMul weights): measured on the
    Qwen3-4B int4 text encoder it saved nothing (1.80 against 1.78 GiB) and made the call 2.2x slower, so it is on by
    default. `threads`: onnxruntime's intra-op threads (None: its default, one per core)."""

    threads: int | None = None
    lean: bool = True
    prepack: bool = True


def _has_bf16_weights(path: Path) -> bool:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(t.data_type == onnx.TensorProto.BFLOAT16 for t in model.graph.initializer)


def session_options(settings: SessionSettings) -> Any:
    """The onnxruntime SessionOptions of `settings` (before the graph is known)."""
    ort = require("onnxruntime")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # warnings about CPU fallbacks would bury the tool's own output
    if settings.threads is not None:
        options.intra_op_num_threads = settings.threads
    if settings.lean:
        options.enable_cpu_mem_arena = False
        options.enable_mem_pattern = False
    if not settings.prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def require(module: str) -> Any:
    """Import one of the `[onnx]` extra's modules, or say which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise DeviceError(f"{module} is not installed; ONNX export and onnxruntime runs need it.",
                          hint=f"Install the extra: {ONNX_EXTRA_HINT}") from e


def check_provider(provider: str) -> None:
    ort = require("onnxruntime")
    available = ort.get_available_providers()
    if provider in available:
        return
    package = PROVIDER_PACKAGES.get(provider)
    if package is None:
        raise DeviceError(f"--provider {provider}: not an onnxruntime execution provider flux-port knows "
                          f"(installed: {', '.join(available)}).",
                          hint="Use one of: " + ", ".join(PROVIDER_PACKAGES) + ".")
    raise DeviceError(f"--provider {provider} is not available in this onnxruntime {ort.__version__} "
                      f"(installed providers: {', '.join(available)}).",
                      hint=f"Install {package} in place of the onnxruntime package "
                           f"(pip uninstall onnxruntime && pip install {package}), then run again.")


def model_path(folder: Path, file: str | None = None) -> Path:
    """The graph of a component folder: `file` when given, else model.onnx or the folder's one .onnx file."""
    if file is not None:
        path = Path(folder) / file
        if not path.is_file():
            raise InputError(f"{folder}: no {file}; the export manifest names it.",
                             hint="The export folder is incomplete; export again.")
        return path
    path = Path(folder) / MODEL_FILE
    if not path.is_file():  # a component folder with one graph of another name (ryzenai's text encoder)
        others = sorted(Path(folder).glob("*.onnx")) if Path(folder).is_dir() else []
        if len(others) == 1:
            return others[0]
        if others:  # a ryzenai export with several --size values: one graph per size
            raise InputError(f"{folder}: {len(others)} graphs ({', '.join(p.name for p in others)}) and no "
                             f"{MODEL_FILE}; say which one to run.",
                             hint="port validate picks the graph of --resolution (one of the export's sizes).")
        raise InputError(f"{folder}: no {MODEL_FILE}; not a component folder written by port export.",
                         hint="Export one first: port export FOLDER --format onnx --out DIR.")
    return path


def open_session(folder: Path, provider: str = "CPUExecutionProvider", file: str | None = None,
                 settings: SessionSettings | None = None) -> Any:
    """An InferenceSession on `folder/model.onnx` (or `file`; external data next to it) with only `provider` (plus
    CPU for the operators the provider does not take, as onnxruntime itself falls back), opened with `settings`
    (default: lean, see SessionSettings)."""
    check_provider(provider)
    ort = require("onnxruntime")
    settings = settings or SessionSettings()
    if settings.threads is not None and (isinstance(settings.threads, bool) or not isinstance(settings.threads, int)
                                         or settings.threads < 1):
        raise UsageError(f"--ort-threads {settings.threads!r}: a whole number of threads, at least 1.")
    options = session_options(settings)
    providers = [provider] if provider == "CPUExecutionProvider" else [provider, "CPUExecutionProvider"]
    try:
        path = model_path(folder, file)
        disabled = ["ConstantFolding"] if settings.lean and _has_bf16_weights(path) else None
        return ort.InferenceSession(str(path), sess_options=options, providers=providers,
                                    disabled_optimizers=disabled)
    except InputError:
        raise
    except Exception as e:  # onnxruntime raises its own exception types for bad graphs and missing data files
        raise InputError(f"{folder}: onnxruntime cannot load {file or MODEL_FILE}: {e}",
                         hint="Export it again with port export; the .onnx.data file must sit next to it.") from e
