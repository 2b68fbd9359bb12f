"""The two targets of `port export --format onnx`, each carrying what differs in the one export driver
(porting/export/onnx.py): its options, memory checks, the export of one component, the check of the finished folder
and its manifest fields.

generic: dynamic batch and sequence axes, traced with `torch.onnx.export(dynamo=True)` (streamed from a hollow model
where every parameter is found by name), fp32 or fp16. ryzenai: the Ryzen AI NPU form (porting/export/ryzenai.py):
static shapes, opset 17, bf16-cast transformer and VAE decoder, int4 text encoder, linted before it is published.
"""

from __future__ import annotations

import gc
import logging
import shutil
import time
import warnings
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable

import torch

from porting._files import read_config
from porting.errors import CheckFailed, UsageError
from porting.families.export_spec import Traceable, gib, nbytes
from porting.resources import (
    MEMORY_OVERHEAD,
    check_static_inputs_memory,
    check_streamed_export_memory,
    require_memory,
)

from .onnx_layout import DATA_SUFFIX, ComponentResult, Layout, layout_of
from .options import check_dtype, check_ryzenai_opset
from .ort import MODEL_FILE, require
from .streamed import hollow_traceable, key_map, stream_component, streamed_bytes

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
DEFAULT_OPSET = 18  # the widest execution-provider support; 23 adds fused Attention and RMSNormalization
MIN_OPSET = 18  # torch's dynamo exporter writes no older opset
# peak RSS of an export: bench/export_onnx.py measured 15.1 GiB for klein-4B shapes in fp16 (7.2 GiB of weights),
# i.e. about twice the weights (the loaded model plus the source file's mapped pages and the bytes being written)
# plus the interpreter with torch, diffusers and the exporter (porting.resources.MEMORY_OVERHEAD)
MEMORY_FACTOR = 2.0


def estimate_bytes(params: int, dtype: torch.dtype) -> int:
    """Expected peak memory of exporting a component of `params` parameters in `dtype`."""
    return int(MEMORY_FACTOR * nbytes(params, dtype)) + MEMORY_OVERHEAD


def max_opset() -> int | None:
    """The newest opset this torch's exporter writes (None when torch does not say)."""
    try:
        from torch.onnx._constants import ONNX_MAX_OPSET
    except ImportError:
        return None
    return int(ONNX_MAX_OPSET)


TARGETS = ("generic", "ryzenai")


def check_opset(opset: object, target: str = "generic") -> int:
    """`--opset` as an int the exporter can write for `target`, or UsageError (exit 2) naming it.

    generic: what torch's dynamo exporter writes (18 up to its newest). ryzenai: 17 exactly (the graph is rewritten
    down to 17 after tracing, porting/export/ryzenai.py)."""
    if target == "ryzenai":
        return check_ryzenai_opset(opset)
    newest = max_opset()
    if isinstance(opset, bool) or not isinstance(opset, int) or opset < MIN_OPSET or (newest and opset > newest):
        raise UsageError(f"--opset {opset!r}: torch {torch.__version__}'s dynamo exporter writes opsets {MIN_OPSET}"
                         + (f" to {newest}." if newest else " and above."),
                         hint=f"Leave --opset out for {DEFAULT_OPSET}, or give 23 to fuse Attention and "
                              "RMSNormalization.")
    return opset


def check_fits(name: str, params: int, dtype: torch.dtype, available: int | None = None,
               hint: str | None = None) -> int:
    """Refuse (exit 2) a component whose export would not fit in `available` bytes (default: the machine's)."""
    weights = nbytes(params, dtype)
    return require_memory(
        f"{name}: exporting {params / 1e9:.2f} B parameters in {str(dtype).removeprefix('torch.')}",
        estimate_bytes(params, dtype), f"{gib(weights)} of weights x {MEMORY_FACTOR} + {gib(MEMORY_OVERHEAD)}",
        available=available,
        hint=hint or ("Export in fp16 (half the weights), on a machine with more memory, or one component at a time "
                      "with --components."))


def _produced_opset(proto: Any) -> int:
    return next((int(o.version) for o in proto.opset_import if o.domain in ("", "ai.onnx")), -1)


def _dims(traced: Traceable) -> dict[str, dict[int, Any]]:
    from torch.export import Dim

    made: dict[str, Any] = {}
    return {k: {axis: made.setdefault(name, Dim(name)) for axis, name in axes.items()}
            for k, axes in traced.dynamic.items()}


def _plan(layout: Layout, component: str, source: Path, dtype: torch.dtype) -> tuple[Traceable, dict[str, str]] | None:
    """The hollow traceable of a component and its parameters' source keys when it can be streamed (every parameter
    found by name in its safetensors files), else None (exported in memory)."""
    try:
        traced = hollow_traceable(layout.spec.components[component], source, dtype)
    except (ValueError, TypeError, AttributeError, KeyError, NotImplementedError, OSError) as e:
        logging.getLogger(__name__).info("%s: no hollow build (%s); exported in memory", component, e)
        return None  # a class that cannot be built from its config alone: the in-memory export, as before
    keys, missing = key_map(traced, source)
    return (traced, keys) if not missing else None


def export_component(traced: Traceable, dest: Path, opset: int) -> int:
    """Trace, save with external data, check by path; returns the opset actually produced.

    The exporter's onnxscript optimiser is off: it folds Linear weights' transposes into new initializers named
    `val_N` (the diffusers names are lost), and on the tiny klein it made onnxruntime's output less accurate
    (2.5e-6 against 9e-7 relative L2) and slower; onnxruntime applies its own graph optimisations at load time.
    """
    onnx = require("onnx")
    require("onnxscript")
    dest.mkdir(parents=True, exist_ok=True)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(traced.module, (), kwargs=traced.example, dynamo=True, opset_version=opset,
                                    dynamic_shapes=_dims(traced), input_names=traced.inputs,
                                    output_names=traced.outputs, verbose=False, optimize=False)
    produced = _produced_opset(program.model_proto)
    program.save(str(dest / MODEL_FILE), external_data=True)
    del program
    onnx.checker.check_model(str(dest / MODEL_FILE))  # by path: works past protobuf's 2 GB
    return produced


def _graph_facts(proto: Any, component: str, file: str) -> dict[str, Any]:
    """A static graph's file (relative to the export), inputs, outputs and input shapes, for the manifest."""
    return {"file": f"{component}/{file}", "inputs": [i.name for i in proto.graph.input],
            "outputs": [o.name for o in proto.graph.output],
            "input_shapes": {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}}


Say = Callable[[str], None]


class Target(ABC):
    """What one export target does at each step of the driver; `prepare` runs before the folder is read."""

    name = "generic"
    packages: tuple[str, ...] = ("onnx", "onnxscript")
    result_dtype = ""

    def __init__(self, opset: int) -> None:
        self.opset = opset
        self.produced = opset
        self.notices: list[str] = []

    @abstractmethod
    def prepare(self, folder: Path) -> None:
        ...

    @abstractmethod
    def check_fit(self, layout: Layout, wanted: list[str], params: dict[str, int],
                  available: int | None) -> None:
        """Refuse, before any tracing, an export that would not fit in memory."""
        ...

    @abstractmethod
    def export(self, component: str, source: Path, dest: Path, params: int, say: Say) -> ComponentResult:
        """Export one component from `source` into `dest` (its folder under the staging folder)."""
        ...

    def finish(self, staging: Path, say: Say) -> dict[str, Any]:
        """Check the staged export; returns the manifest fields of the check."""
        return {}

    def source_fields(self, folder: Path, sources: dict[str, Path]) -> dict[str, Any]:
        return {}

    @abstractmethod
    def manifest_fields(self, layout: Layout) -> dict[str, Any]:
        ...


class Generic(Target):
    """Dynamic axes, fp32 or fp16, any opset torch's exporter writes."""

    def __init__(self, opset: int, dtype: str, profile: Any = None) -> None:
        super().__init__(opset)
        self.dtype, self.profile, self.result_dtype = dtype, profile, dtype
        self.plans: dict[str, tuple[Traceable, dict[str, str]] | None] = {}
        self.produced_opsets: set[int] = set()
        self.layout: Layout | None = None
        self.torch_dtype = torch.float32

    def prepare(self, folder: Path) -> None:
        if self.profile is not None:
            raise UsageError("--size, --text-len, --block-size and --accuracy-level belong to --target ryzenai.")
        check_dtype(self.dtype)
        check_opset(self.opset)
        self.torch_dtype = DTYPES[self.dtype]

    def check_fit(self, layout: Layout, wanted: list[str], params: dict[str, int],
                  available: int | None) -> None:
        self.layout, dtype = layout, self.torch_dtype
        self.plans = {c: _plan(layout, c, layout.sources[c], dtype) for c in wanted}  # hollow builds: no weight read
        for c in wanted:
            if self.plans[c] is not None:
                check_streamed_export_memory(c, layout.sources[c], available=available,
                                             estimate=lambda f: streamed_bytes(f, dtype))
            else:
                check_fits(c, params[c], dtype, available)

    def export(self, component: str, source: Path, dest: Path, params: int, say: Say) -> ComponentResult:
        c = component
        say(f"exporting {c} ({params / 1e6:.1f} M parameters, {self.dtype}, opset {self.opset})")
        t0 = time.perf_counter()
        plan = self.plans.pop(c)
        if plan is not None:  # hollow trace, the weights written from the source one tensor at a time
            traced, keys = plan
            produced = stream_component(traced, source, keys, self.torch_dtype, self.opset, _dims(traced), dest,
                                        MODEL_FILE)
            traced.facts = {**traced.facts, "streamed": True}
        else:
            assert self.layout is not None
            traced = self.layout.spec.components[c].load(source, self.torch_dtype)
            produced = export_component(traced, dest, self.opset)
            traced.facts = {**traced.facts, "streamed": False}  # its keys do not match its module's names
        self.produced_opsets.add(produced)
        result = ComponentResult(
            name=c, inputs=traced.inputs, outputs=traced.outputs, dynamic_axes=traced.dynamic, params=params,
            onnx_bytes=(dest / MODEL_FILE).stat().st_size,
            data_bytes=(dest / (MODEL_FILE + DATA_SUFFIX)).stat().st_size
            if (dest / (MODEL_FILE + DATA_SUFFIX)).is_file() else 0,
            export_s=round(time.perf_counter() - t0, 2), facts=traced.facts)
        del traced
        gc.collect()  # the next component's weights should not sit next to this one's
        return result

    def finish(self, staging: Path, say: Say) -> dict[str, Any]:
        self.produced = max(self.produced_opsets) if self.produced_opsets else self.opset
        if self.produced != self.opset:
            self.notices.append(f"asked for opset {self.opset}, the exporter produced opset {self.produced}")
        return {}

    def manifest_fields(self, layout: Layout) -> dict[str, Any]:
        return {"family": layout.family, "model": layout.spec.title, "class_name": layout.class_name,
                "dtype": self.dtype, "opset": {"requested": self.opset, "produced": self.produced}}


class RyzenAI(Target):
    """Static shapes, opset 17, bf16-cast transformer and VAE decoder, int4 text encoder, linted when written."""

    name = "ryzenai"
    packages = ("onnx", "onnxscript", "onnxruntime")  # onnxruntime: the int4 quantizer
    result_dtype = "ryzenai (bf16-cast transformer and VAE decoder, int4 text encoder)"

    def __init__(self, opset: int, profile: Any = None) -> None:
        super().__init__(opset)
        self.profile = profile

    def prepare(self, folder: Path) -> None:
        from . import ryzenai

        check_opset(self.opset, "ryzenai")
        layout = layout_of(folder)  # what the model's family declares, before any work
        if not layout.spec.ryzenai:
            raise UsageError(f"--target ryzenai: {folder} is {layout.spec.title} ({layout.class_name}); the Ryzen AI "
                             f"flow is written for {ryzenai.FLOW_FOR} only (its static shapes, bf16 transformer and "
                             "int4 text encoder).", hint="Export it with --target generic (the default).")
        self.profile = self.profile or ryzenai.Profile()
        p = self.profile
        ryzenai.check_profile(p.size, p.text_len, p.block_size, p.accuracy_level)

    def check_fit(self, layout: Layout, wanted: list[str], params: dict[str, int],
                  available: int | None) -> None:
        from .streamed_text import streamed_text_encoder_bytes

        sources = layout.sources
        if "transformer" in sources:
            check_static_inputs_memory(self.profile.sizes, self.profile.text_len,
                                       read_config(sources["transformer"] / "config.json", "the transformer's config"),
                                       available=available)
        for c in wanted:  # every component is traced hollow and its weights streamed tensor by tensor: the estimate
            # is the interpreter, the graph and the largest tensor in flight (resources.streamed_export_bytes)
            check_streamed_export_memory(c, sources[c], available=available,
                                         estimate=streamed_text_encoder_bytes if c == "text_encoder" else None)

    def _graphs(self, c: str, source: Path, dest: Path, params: int,
                say: Say) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """The static graphs of a component written into `dest`, by size, and the facts of the last one."""
        from . import ryzenai

        profile, graphs = self.profile, {}
        if c == "text_encoder":
            say(f"exporting {c} for ryzenai ({params / 1e6:.1f} M parameters, opset {self.opset}, static shapes, "
                f"int4 blocks of {profile.block_size} quantized as read)")
            from .streamed_text import stream_int4_text_encoder

            proto, facts = stream_int4_text_encoder(source, profile, dest)
            ryzenai.save_streamed(proto, dest, facts["file"], facts["data_file"])
            graphs[str(profile.size)] = _graph_facts(proto, c, facts["file"])
            del proto
            gc.collect()
        elif c in ryzenai.STREAMED:
            written: dict[str, Any] = {}  # the first size writes the weights, the others point at them
            for size in (profile.sizes if c in ryzenai.SIZED else (profile.size,)):
                say(f"exporting {c} for ryzenai ({params / 1e6:.1f} M parameters, opset {self.opset}, static "
                    f"shapes" + (f", size {size}" if c in ryzenai.SIZED else "") + ")")
                proto, facts = ryzenai.stream_bf16_component(c, source, profile, dest, size=size, written=written)
                ryzenai.save_streamed(proto, dest, facts["file"], facts["data_file"])
                graphs[str(size)] = _graph_facts(proto, c, facts["file"])
                del proto
                gc.collect()
        else:  # the families declare no other ryzenai component (ryzenai.finish_component: the in-memory reference)
            raise ValueError(f"{c}: the ryzenai profile has no export for this component")
        return graphs, facts

    def export(self, component: str, source: Path, dest: Path, params: int, say: Say) -> ComponentResult:
        from . import ryzenai

        c = component
        t0 = time.perf_counter()
        graphs, facts = self._graphs(c, source, dest, params, say)
        first = next(iter(graphs.values()))
        if (source / "config.json").is_file():
            shutil.copy2(source / "config.json", dest / "config.json")
        data = dest / (ryzenai.FILES[c] + DATA_SUFFIX)
        facts = {k: v for k, v in facts.items() if k not in ("size", "weights_written")}
        facts.update(file=first["file"].split("/", 1)[1], input_shapes=first["input_shapes"])
        if c in ryzenai.SIZED and len(self.profile.sizes) > 1:
            facts["graphs"] = graphs  # one static graph per --size, all reading facts["data_file"]
        return ComponentResult(
            name=c, inputs=first["inputs"], outputs=first["outputs"], dynamic_axes={}, params=params,
            onnx_bytes=sum((dest.parent / g["file"]).stat().st_size for g in graphs.values()),
            data_bytes=data.stat().st_size if data.is_file() else 0,
            export_s=round(time.perf_counter() - t0, 2), facts=facts)

    def finish(self, staging: Path, say: Say) -> dict[str, Any]:
        from .lint import lint

        say("checking the export against the ryzenai rules")
        checked = lint(staging, "ryzenai")
        if checked.findings:
            raise CheckFailed(f"the ryzenai export does not pass its own check ({len(checked.findings)} finding(s)); "
                              f"first: {checked.findings[0].file}: {checked.findings[0].check}: "
                              f"{checked.findings[0].detail}", hint="Nothing was written. Report this as a bug.")
        return {"check": checked.to_dict()}

    def source_fields(self, folder: Path, sources: dict[str, Path]) -> dict[str, Any]:
        return {"text_encoder": str(sources["text_encoder"].resolve()) if "text_encoder" in sources else None,
                "tokenizer": str((folder / "tokenizer").resolve()) if (folder / "tokenizer").is_dir() else None}

    def manifest_fields(self, layout: Layout) -> dict[str, Any]:
        p = self.profile
        return {"target": "ryzenai", "dtype": "bf16", "compute_dtype": "fp32",
                "opset": {"requested": self.opset, "produced": self.opset},
                "profile": {"size": p.size, "sizes": list(p.sizes), "text_len": p.text_len, "batch": 1,
                            "block_size": p.block_size, "accuracy_level": p.accuracy_level}}


def target_for(target: str, *, opset: int | None, dtype: str, profile: Any) -> Target:
    """The target object of `--target` (opset defaulted: 17 for ryzenai, DEFAULT_OPSET otherwise)."""
    if target not in TARGETS:
        raise UsageError(f"--target {target!r}: choose one of {', '.join(TARGETS)}.")
    if opset is None:
        opset = 17 if target == "ryzenai" else DEFAULT_OPSET
    return RyzenAI(opset, profile) if target == "ryzenai" else Generic(opset, dtype, profile)
