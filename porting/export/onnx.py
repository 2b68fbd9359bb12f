"""`port export FOLDER --format onnx`: a diffusers folder to one ONNX folder per component.

Each component is traced with `torch.onnx.export(dynamo=True)` with the batch and sequence axes dynamic, checked by
path with `onnx.checker` and saved as `model.onnx` + `model.onnx.data` (weights always external: klein-4B in fp32 is
15.5 GB, far above protobuf's 2 GB). Tokenizer and scheduler are copied. `flux-port-export.json` names the source
folder and its transformer weights hash, which `port validate --runtime onnxruntime` uses as the golden's weights.

One driver for both targets (select, fit, check the output, hash, export each component, copy, check, manifest);
what differs between plain ONNX and Ryzen AI is carried by the target object (porting/export/onnx_targets.py). What
is exported from a folder is read in porting/export/onnx_layout.py.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from porting import __version__
from porting.finite import dumps
from porting.inputs import open_source
from porting.outputs import atomic_folder, check_output

from . import identity
from .onnx_layout import (
    MANIFEST,
    ComponentResult,
    Layout,
    copy_folders,
    files_to_copy,
    find_manifest,
    layout_of,
    model_spec,
    select,
    step_sizes,
)
from .onnx_targets import (
    DEFAULT_OPSET,
    DTYPES,
    TARGETS,
    Target,
    check_fits,
    check_opset,
    export_component,
    target_for,
)
from .ort import MODEL_FILE, require

__all__ = ["DEFAULT_OPSET", "DTYPES", "MANIFEST", "TARGETS", "ComponentResult", "ExportResult", "Layout",
           "check_fits", "check_opset", "export_component", "export_onnx", "find_manifest", "layout_of",
           "model_spec"]

# the manifest's keys in the order written; a target fills in its own (porting/export/onnx_targets.py)
MANIFEST_ORDER = ("tool", "version", "format_version", "kind", "target", "created", "source", "family", "model",
                  "class_name", "dtype", "compute_dtype", "opset", "profile", "components", "copied", "check",
                  "environment", "notices", "identities")


@dataclass
class ExportResult:
    out: str
    dtype: str
    opset_requested: int
    opset_produced: int
    source: str
    weights_sha256: str | None
    components: list[ComponentResult]
    copied: list[str]
    notices: list[str]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _identities(borrowed: dict[str, Any], staging: Path, names: list[str]) -> dict[str, Any]:
    """The manifest's `identities`: the source's components as they were when the export began, the export's own as
    written (`porting/export/identity.py`)."""
    return {"source": borrowed, "export": identity.exported({n: staging / n for n in names})}


def _manifest(target: Target, folder: Path, layout: Layout, weights: str | None, results: list[ComponentResult],
              copied: list[str], checked: dict[str, Any], identities: dict[str, Any]) -> dict[str, Any]:
    sources = layout.sources
    onnx = require("onnx")
    fields = {
        "tool": "flux-port", "version": __version__, "format_version": 1, "kind": "onnx-export",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": {"folder": str(folder.resolve()), "layout": layout.kind,
                   "transformer": str(sources["transformer"].resolve()) if "transformer" in sources else None,
                   **target.source_fields(folder, sources), "weights_sha256": weights},
        # a component's facts may name its file (ryzenai: the file inside the component's folder)
        "components": {r.name: {"file": f"{r.name}/{MODEL_FILE}", "inputs": r.inputs, "outputs": r.outputs,
                                "dynamic_axes": r.dynamic_axes, "params": r.params, **r.facts} for r in results},
        "copied": copied,
        "environment": {"torch": torch.__version__, "onnx": onnx.__version__,
                        "onnxscript": _version("onnxscript"), "onnxruntime": _version("onnxruntime")},
        "notices": target.notices, "identities": identities, **checked, **target.manifest_fields(layout)}
    return {k: fields[k] for k in MANIFEST_ORDER if k in fields}


def export_onnx(folder: str | Path, out: str | Path, *, dtype: str = "fp32", opset: int | None = None,
                components: Sequence[str] | None = None, force: bool = False,
                available_bytes: int | None = None, target: str = "generic", profile: Any = None,
                on_status: Callable[..., None] | None = None) -> ExportResult:
    """Export the components of `folder` into `out` (atomically: nothing is left behind on failure).

    `on_status(text)` hears each step; a component's step also passes `size=` (its parameters) and `left=` (the
    parameters of the components still to come), so that a caller can time the steps and estimate the rest
    (porting.progress.TimedSteps).

    `target="ryzenai"` writes the Ryzen AI NPU form (porting/export/ryzenai.py) with `profile` (a
    `ryzenai.Profile`: size, text length, int4 block size, accuracy level); `dtype` is then the profile's."""
    started = time.perf_counter()
    folder, out = Path(folder), Path(out)
    say = on_status or (lambda text, **sizes: None)
    how = target_for(target, opset=opset, dtype=dtype, profile=profile)
    how.prepare(folder)
    for package in how.packages:
        require(package)
    layout, wanted, params = select(folder, components)
    sources = layout.sources
    how.check_fit(layout, wanted, params, available_bytes)  # refuse before any tracing
    copies = files_to_copy(folder, layout)
    read_paths = {"source": folder, "component": list(sources.values()),
                  "copied folder": [folder / name for name in copies]}
    check_output(out, force=force, verb="export", inputs=read_paths)  # before any tracing
    weights = None
    if "transformer" in sources:
        say(f"hashing the transformer weights in {sources['transformer']}")
        weights = open_source(sources["transformer"], kind="weights").weights_sha256
    borrowed_ids = identity.borrowed(identity.source_components(folder, layout.kind, sources.get("transformer")))
    results: list[ComponentResult] = []
    with atomic_folder(out, force=force, verb="export", inputs=read_paths) as staging:
        for c in wanted:
            sizes = step_sizes(wanted, c, params)
            results.append(how.export(c, sources[c], staging / c, params[c],
                                      lambda text, sizes=sizes: say(text, **sizes)))
        if copies:
            say(f"copying {', '.join(copies)} from {folder}")
        copied = copy_folders(folder, staging, copies)
        checked = how.finish(staging, say)
        identities = _identities(borrowed_ids, staging, [r.name for r in results] + copied)
        manifest = _manifest(how, folder, layout, weights, results, copied, checked, identities)
        (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
    return ExportResult(out=str(out), dtype=how.result_dtype, opset_requested=how.opset, opset_produced=how.produced,
                        source=str(folder), weights_sha256=weights, components=results, copied=copied,
                        notices=how.notices, seconds=round(time.perf_counter() - started, 2))
