"""`port export FOLDER --format onnx`: a diffusers folder to one ONNX folder per component.

Each component is traced with `torch.onnx.export(dynamo=True)` with the batch and sequence axes dynamic, checked by
path with `onnx.checker` and saved as `model.onnx` + `model.onnx.data` (weights always external: klein-4B in fp32 is
15.5 GB, far above protobuf's 2 GB). Tokenizer and scheduler are copied. `flux-port-export.json` names the source
folder and its transformer weights hash, which `port validate --runtime onnxruntime` uses as the golden's weights.
"""

from __future__ import annotations

import datetime as _dt
import gc
import importlib.metadata
import logging
import shutil
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from porting import __version__
from porting._files import read_config, read_json_object
from porting.errors import CheckFailed, InputError, PortError, UsageError
from porting.families.export_spec import ExportSpec, Traceable, gib, nbytes
from porting.finite import dumps
from porting.inputs import open_source
from porting.outputs import atomic_folder, check_output
from porting.paths import files_within, link_roots
from porting.resources import (
    MEMORY_OVERHEAD,
    check_component_configs,
    check_static_inputs_memory,
    check_streamed_export_memory,
    require_memory,
)

from . import identity
from .ort import MODEL_FILE, require
from .streamed import hollow_traceable, key_map, stream_component, streamed_bytes

MANIFEST = "flux-port-export.json"
DATA_SUFFIX = ".data"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
DEFAULT_OPSET = 18  # the widest execution-provider support; 23 adds fused Attention and RMSNormalization
MIN_OPSET = 18  # torch's dynamo exporter writes no older opset
# peak RSS of an export: bench/export_onnx.py measured 15.1 GiB for klein-4B shapes in fp16 (7.2 GiB of weights),
# i.e. about twice the weights (the loaded model plus the source file's mapped pages and the bytes being written)
# plus the interpreter with torch, diffusers and the exporter (porting.resources.MEMORY_OVERHEAD)
MEMORY_FACTOR = 2.0
BF16_REFUSAL = ("--dtype bf16: onnxruntime's CPU execution provider has no bf16 kernels (bf16 Mul fails to load), "
                "so a bf16 export cannot be validated or run on CPU.")


@dataclass
class ComponentResult:
    name: str
    inputs: list[str]
    outputs: list[str]
    dynamic_axes: dict[str, dict[int, str]]
    params: int
    onnx_bytes: int
    data_bytes: int
    export_s: float
    facts: dict[str, Any] = field(default_factory=dict)


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


def find_manifest(path: Path) -> tuple[Path, dict[str, Any]]:
    """The export manifest for an export folder or one of its component folders."""
    path = Path(path)
    for folder in (path, path.parent):
        if (folder / MANIFEST).is_file():
            manifest = read_json_object(folder / MANIFEST, "written by port export")
            for field, kind in (("source", dict), ("components", dict), ("dtype", str)):
                if not isinstance(manifest.get(field), kind):
                    raise InputError(f"{folder / MANIFEST}: {field!r} is {manifest.get(field)!r}; port export writes "
                                     f"{'an object' if kind is dict else 'a string'} there.",
                                     hint="The manifest is damaged or hand-edited; export again.")
            return folder, manifest
    raise InputError(f"{path}: no {MANIFEST} here or in the folder above; not written by port export.",
                     hint="Export first: port export FOLDER --format onnx --out DIR, then use DIR/transformer.")


@dataclass(frozen=True)
class Layout:
    """What is exported from a folder: its component source folders, pipeline or lone transformer, and what the
    model's family declares it exports."""

    sources: dict[str, Path]
    kind: str  # "pipeline" or "transformer"
    spec: ExportSpec
    family: str  # the family's registry name
    class_name: str  # the transformer's diffusers class


def model_spec(transformer_config: Path, pipeline_class: str | None = None) -> tuple[ExportSpec, str, str]:
    """The one seam between the export and the families: the family of a transformer config's `_class_name`, and the
    components it declares (for the pipeline class model_index.json names, when there is one)."""
    from porting.families import family_for_class

    cfg = read_config(transformer_config, "a transformer config")
    class_name = cfg.get("_class_name")
    try:
        family = family_for_class(str(class_name))
        spec = family.export_spec(cfg, pipeline_class)
    except KeyError as e:
        raise InputError(f"{transformer_config}: '_class_name' is {class_name!r}; port export knows no family "
                         f"that exports it ({e.args[0]}).",
                         hint="Point at a published folder (port publish --out) or a converted transformer "
                              "(port convert --out).") from None
    return spec, family.name, str(class_name)


def _layout(folder: Path) -> Layout:
    """Component source folders of a pipeline folder, or of a lone transformer folder."""
    if (folder / "model_index.json").is_file():
        index = read_config(folder / "model_index.json", "a pipeline index")
        if not (folder / "transformer" / "config.json").is_file():
            raise InputError(f"{folder}: no transformer/config.json; port export reads the model's family there.")
        spec, family, class_name = model_spec(folder / "transformer" / "config.json", index.get("_class_name"))
        sources = {name: folder / c.source for name, c in spec.components.items() if (folder / c.source).is_dir()}
        return Layout(sources, "pipeline", spec, family, class_name)
    if (folder / "config.json").is_file():
        spec, family, class_name = model_spec(folder / "config.json")
        return Layout({"transformer": folder}, "transformer", spec, family, class_name)
    raise InputError(f"{folder}: neither a diffusers pipeline folder (model_index.json) nor a transformer "
                     "folder (config.json).", hint="Point at a published folder (port publish --out) or a "
                                                   "converted transformer (port convert --out).")


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
        from .ryzenai import OPSET

        if isinstance(opset, bool) or opset != OPSET:
            raise UsageError(f"--opset {opset!r}: --target ryzenai writes opset {OPSET} exactly (Ryzen AI's "
                             "recommended opset).", hint="Leave --opset out with --target ryzenai.")
        return OPSET
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


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


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


def files_to_copy(folder: Path, layout: Layout) -> dict[str, list[Path]]:
    """The files of the weightless folders (tokenizers, scheduler) an export carries, listed before any work; a link
    is followed only when it stays inside the source folder."""
    if layout.kind != "pipeline":
        return {}
    return {name: files_within(folder / name, link_roots(folder)) for name in layout.spec.copied
            if (folder / name).is_dir()}


def _selected(folder: Path, components: Sequence[str] | None) -> tuple[Layout, list[str], dict[str, int]]:
    """The layout of `folder`, the components asked for (all it has by default) and their parameter counts."""
    layout = _layout(folder)
    spec, sources = layout.spec, layout.sources
    wanted = list(components) if components else list(sources)
    refused = [c for c in wanted if c in spec.refused]
    if refused:
        raise UsageError(f"--components {refused[0]}: {spec.title} does not export it: {spec.refused[refused[0]]}",
                         hint="Leave it out of --components.")
    unknown = [c for c in wanted if c not in spec.components]
    if unknown:
        raise PortError(f"--components {','.join(unknown)}: unknown for {spec.title}; choose from "
                        f"{', '.join(spec.components)}.")
    missing = [c for c in wanted if c not in sources]
    if missing:
        raise InputError(f"{folder}: no {', '.join(spec.components[c].source + '/' for c in missing)} folder to "
                         f"export {', '.join(missing)} from.")
    check_component_configs({c: sources[c] for c in wanted}, nbytes=0)  # hollow builds: the modules only
    params = {c: spec.components[c].count_params(sources[c]) for c in wanted}
    return layout, wanted, params


def _sizes(wanted: Sequence[str], component: str, params: dict[str, int]) -> dict[str, int]:
    """`size` and `left` of a component's step: its parameters, and those of the components after it."""
    after = list(wanted)[list(wanted).index(component) + 1:]
    return {"size": params[component], "left": sum(params[c] for c in after)}


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
    if target not in TARGETS:
        raise UsageError(f"--target {target!r}: choose one of {', '.join(TARGETS)}.")
    if opset is None:
        opset = 17 if target == "ryzenai" else DEFAULT_OPSET
    if target == "ryzenai":
        return _export_ryzenai(folder, out, opset=opset, components=components, force=force,
                               available_bytes=available_bytes, profile=profile, say=say, started=started)
    if profile is not None:
        raise UsageError("--size, --text-len, --block-size and --accuracy-level belong to --target ryzenai.")
    if dtype == "bf16":
        raise PortError(BF16_REFUSAL, hint="Use --dtype fp16 (half the size, runs on every provider) or fp32.")
    if dtype not in DTYPES:
        raise PortError(f"--dtype {dtype!r}: choose fp32 or fp16.")
    check_opset(opset)
    require("onnx")
    require("onnxscript")
    torch_dtype = DTYPES[dtype]
    layout, wanted, params = _selected(folder, components)
    sources, kind = layout.sources, layout.kind
    plans = {c: _plan(layout, c, sources[c], torch_dtype) for c in wanted}  # hollow builds: no weight read
    for c in wanted:  # refuse before any tracing
        if plans[c] is not None:
            check_streamed_export_memory(c, sources[c], available=available_bytes,
                                         estimate=lambda f: streamed_bytes(f, torch_dtype))
        else:
            check_fits(c, params[c], torch_dtype, available_bytes)
    copies = files_to_copy(folder, layout)
    read_paths = {"source": folder, "component": list(sources.values()),
                  "copied folder": [folder / name for name in copies]}
    check_output(out, force=force, verb="export", inputs=read_paths)  # before any tracing
    weights = None
    if "transformer" in sources:
        say(f"hashing the transformer weights in {sources['transformer']}")
        weights = open_source(sources["transformer"], kind="weights").weights_sha256
    borrowed_ids = identity.borrowed(identity.source_components(folder, kind, sources.get("transformer")))
    notices: list[str] = []
    results: list[ComponentResult] = []
    produced_opsets: set[int] = set()
    copied: list[str] = []
    with atomic_folder(out, force=force, verb="export", inputs=read_paths) as staging:
        for c in wanted:
            say(f"exporting {c} ({params[c] / 1e6:.1f} M parameters, {dtype}, opset {opset})",
                **_sizes(wanted, c, params))
            t0 = time.perf_counter()
            plan = plans.pop(c)
            if plan is not None:  # hollow trace, the weights written from the source one tensor at a time
                traced, keys = plan
                produced = stream_component(traced, sources[c], keys, torch_dtype, opset, _dims(traced), staging / c,
                                            MODEL_FILE)
                traced.facts = {**traced.facts, "streamed": True}
            else:
                traced = layout.spec.components[c].load(sources[c], torch_dtype)
                produced = export_component(traced, staging / c, opset)
                traced.facts = {**traced.facts, "streamed": False}  # its keys do not match its module's names
            produced_opsets.add(produced)
            results.append(ComponentResult(
                name=c, inputs=traced.inputs, outputs=traced.outputs, dynamic_axes=traced.dynamic, params=params[c],
                onnx_bytes=(staging / c / MODEL_FILE).stat().st_size,
                data_bytes=(staging / c / (MODEL_FILE + DATA_SUFFIX)).stat().st_size
                if (staging / c / (MODEL_FILE + DATA_SUFFIX)).is_file() else 0,
                export_s=round(time.perf_counter() - t0, 2), facts=traced.facts))
            del traced
            gc.collect()  # the next component's weights should not sit next to this one's
        if copies:
            say(f"copying {', '.join(copies)} from {folder}")
        copied += _copy_folders(folder, staging, copies)
        produced = max(produced_opsets) if produced_opsets else opset
        if produced != opset:
            notices.append(f"asked for opset {opset}, the exporter produced opset {produced}")
        onnx = require("onnx")
        manifest = {
            "tool": "flux-port", "version": __version__, "format_version": 1, "kind": "onnx-export",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "source": {"folder": str(folder.resolve()), "layout": kind,
                       "transformer": str(sources["transformer"].resolve()) if "transformer" in sources else None,
                       "weights_sha256": weights},
            "family": layout.family, "model": layout.spec.title, "class_name": layout.class_name,
            "dtype": dtype, "opset": {"requested": opset, "produced": produced},
            "components": {r.name: {"file": f"{r.name}/{MODEL_FILE}", "inputs": r.inputs, "outputs": r.outputs,
                                    "dynamic_axes": r.dynamic_axes, "params": r.params, **r.facts}
                           for r in results},
            "copied": copied,
            "environment": {"torch": torch.__version__, "onnx": onnx.__version__,
                            "onnxscript": _version("onnxscript"), "onnxruntime": _version("onnxruntime")},
            "notices": notices,
            "identities": _identities(borrowed_ids, staging, [r.name for r in results] + copied),
        }
        (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
    return ExportResult(out=str(out), dtype=dtype, opset_requested=opset, opset_produced=produced,
                        source=str(folder), weights_sha256=weights, components=results, copied=copied,
                        notices=notices, seconds=round(time.perf_counter() - started, 2))


def _identities(borrowed: dict[str, Any], staging: Path, names: list[str]) -> dict[str, Any]:
    """The manifest's `identities`: the source's components as they were when the export began, the export's own as
    written (`porting/export/identity.py`)."""
    return {"source": borrowed, "export": identity.exported({n: staging / n for n in names})}


def _copy_folders(folder: Path, staging: Path, copies: dict[str, list[Path]]) -> list[str]:
    copied = []
    for name, files in copies.items():
        (staging / name).mkdir()
        for f in files:
            dest = staging / name / f.relative_to(folder / name)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
        copied.append(name)
    return copied


def _graph_facts(proto: Any, component: str, file: str) -> dict[str, Any]:
    """A static graph's file (relative to the export), inputs, outputs and input shapes, for the manifest."""
    return {"file": f"{component}/{file}", "inputs": [i.name for i in proto.graph.input],
            "outputs": [o.name for o in proto.graph.output],
            "input_shapes": {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input}}


def _export_ryzenai(folder: Path, out: Path, *, opset: int, components: Sequence[str] | None, force: bool,
                    available_bytes: int | None, profile: Any, say: Callable[[str], None],
                    started: float) -> ExportResult:
    """The Ryzen AI profile: static shapes, opset 17, bf16-cast transformer and VAE decoder, int4 text encoder,
    the lint run on the result before the folder is published."""
    from . import ryzenai
    from .lint import lint

    check_opset(opset, "ryzenai")
    layout = _layout(folder)  # what the model's family declares, before any work
    if not layout.spec.ryzenai:
        raise UsageError(f"--target ryzenai: {folder} is {layout.spec.title} ({layout.class_name}); the Ryzen AI "
                         f"flow is written for {ryzenai.FLOW_FOR} only (its static shapes, bf16 transformer and int4 "
                         "text encoder).", hint="Export it with --target generic (the default).")
    profile = profile or ryzenai.Profile()
    ryzenai.check_profile(profile.size, profile.text_len, profile.block_size, profile.accuracy_level)
    require("onnx")
    require("onnxscript")
    require("onnxruntime")  # the int4 quantizer
    layout, wanted, params = _selected(folder, components)
    sources, kind = layout.sources, layout.kind
    if "transformer" in sources:
        check_static_inputs_memory(profile.sizes, profile.text_len,
                                   read_config(sources["transformer"] / "config.json", "the transformer's config"),
                                   available=available_bytes)
    from .streamed_text import streamed_text_encoder_bytes

    for c in wanted:  # every component is traced hollow and its weights streamed tensor by tensor: the estimate is
        # the interpreter, the graph and the largest tensor in flight (resources.streamed_export_bytes)
        check_streamed_export_memory(c, sources[c], available=available_bytes,
                                     estimate=streamed_text_encoder_bytes if c == "text_encoder" else None)
    copies = files_to_copy(folder, layout)
    read_paths = {"source": folder, "component": list(sources.values()),
                  "copied folder": [folder / name for name in copies]}
    check_output(out, force=force, verb="export", inputs=read_paths)
    weights = None
    if "transformer" in sources:
        say(f"hashing the transformer weights in {sources['transformer']}")
        weights = open_source(sources["transformer"], kind="weights").weights_sha256
    borrowed_ids = identity.borrowed(identity.source_components(folder, kind, sources.get("transformer")))
    results: list[ComponentResult] = []
    with atomic_folder(out, force=force, verb="export", inputs=read_paths) as staging:
        for c in wanted:
            t0 = time.perf_counter()
            graphs: dict[str, dict[str, Any]] = {}
            if c == "text_encoder":
                say(f"exporting {c} for ryzenai ({params[c] / 1e6:.1f} M parameters, opset {opset}, static shapes, "
                    f"int4 blocks of {profile.block_size} quantized as read)", **_sizes(wanted, c, params))
                from .streamed_text import stream_int4_text_encoder

                proto, facts = stream_int4_text_encoder(sources[c], profile, staging / c)
                ryzenai.save_streamed(proto, staging / c, facts["file"], facts["data_file"])
                graphs[str(profile.size)] = _graph_facts(proto, c, facts["file"])
                del proto
                gc.collect()
            elif c in ryzenai.STREAMED:
                written: dict[str, Any] = {}  # the first size writes the weights, the others point at them
                for size in (profile.sizes if c in ryzenai.SIZED else (profile.size,)):
                    say(f"exporting {c} for ryzenai ({params[c] / 1e6:.1f} M parameters, opset {opset}, static "
                        f"shapes" + (f", size {size}" if c in ryzenai.SIZED else "") + ")", **_sizes(wanted, c, params))
                    proto, facts = ryzenai.stream_bf16_component(c, sources[c], profile, staging / c, size=size,
                                                                 written=written)
                    ryzenai.save_streamed(proto, staging / c, facts["file"], facts["data_file"])
                    graphs[str(size)] = _graph_facts(proto, c, facts["file"])
                    del proto
                    gc.collect()
            else:  # the families declare no other ryzenai component (ryzenai.finish_component: the in-memory reference)
                raise ValueError(f"{c}: the ryzenai profile has no export for this component")
            first = next(iter(graphs.values()))
            if (sources[c] / "config.json").is_file():
                shutil.copy2(sources[c] / "config.json", staging / c / "config.json")
            data = staging / c / (ryzenai.FILES[c] + DATA_SUFFIX)
            facts = {k: v for k, v in facts.items() if k not in ("size", "weights_written")}
            facts.update(file=first["file"].split("/", 1)[1], input_shapes=first["input_shapes"])
            if c in ryzenai.SIZED and len(profile.sizes) > 1:
                facts["graphs"] = graphs  # one static graph per --size, all reading facts["data_file"]
            results.append(ComponentResult(
                name=c, inputs=first["inputs"], outputs=first["outputs"], dynamic_axes={}, params=params[c],
                onnx_bytes=sum((staging / g["file"]).stat().st_size for g in graphs.values()),
                data_bytes=data.stat().st_size if data.is_file() else 0,
                export_s=round(time.perf_counter() - t0, 2), facts=facts))
        if copies:
            say(f"copying {', '.join(copies)} from {folder}")
        copied = _copy_folders(folder, staging, copies)
        say("checking the export against the ryzenai rules")
        checked = lint(staging, "ryzenai")
        if checked.findings:
            raise CheckFailed(f"the ryzenai export does not pass its own check ({len(checked.findings)} finding(s)); "
                              f"first: {checked.findings[0].file}: {checked.findings[0].check}: "
                              f"{checked.findings[0].detail}", hint="Nothing was written. Report this as a bug.")
        onnx = require("onnx")
        manifest = {
            "tool": "flux-port", "version": __version__, "format_version": 1, "kind": "onnx-export",
            "target": "ryzenai",
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "source": {"folder": str(folder.resolve()), "layout": kind,
                       "transformer": str(sources["transformer"].resolve()) if "transformer" in sources else None,
                       "text_encoder": str(sources["text_encoder"].resolve()) if "text_encoder" in sources else None,
                       "tokenizer": str((folder / "tokenizer").resolve()) if (folder / "tokenizer").is_dir() else None,
                       "weights_sha256": weights},
            "dtype": "bf16", "compute_dtype": "fp32", "opset": {"requested": opset, "produced": opset},
            "profile": {"size": profile.size, "sizes": list(profile.sizes), "text_len": profile.text_len, "batch": 1,
                        "block_size": profile.block_size, "accuracy_level": profile.accuracy_level},
            "components": {r.name: {"file": f"{r.name}/{r.facts['file']}", "inputs": r.inputs, "outputs": r.outputs,
                                    "dynamic_axes": {}, "params": r.params, **r.facts} for r in results},
            "copied": copied, "check": checked.to_dict(),
            "environment": {"torch": torch.__version__, "onnx": onnx.__version__,
                            "onnxscript": _version("onnxscript"), "onnxruntime": _version("onnxruntime")},
            "notices": [],
            "identities": _identities(borrowed_ids, staging, [r.name for r in results] + copied),
        }
        (staging / MANIFEST).write_text(dumps(manifest, indent=2) + "\n")
    return ExportResult(out=str(out), dtype="ryzenai (bf16-cast transformer and VAE decoder, int4 text encoder)",
                        opset_requested=opset, opset_produced=opset, source=str(folder), weights_sha256=weights,
                        components=results, copied=copied, notices=[],
                        seconds=round(time.perf_counter() - started, 2))
