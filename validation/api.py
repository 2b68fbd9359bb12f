"""`validate()`: the whole check of one transformer on one device, producing a Report."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from porting import __version__
from porting.devices import resolve_device
from porting.errors import CheckFailed, InputError, PortError
from porting.outputs import check_output
from porting.resources import check_validate_memory

from .checks import GoldenWeights, check_dequantized, check_measurable, check_not_one_computation
from .compare import GROWTH_FLAG, Runs, lockstep
from .inputs import Inputs, build_inputs
from .metrics import compare, error_floor, error_ratio
from .report import Report, original_name
from .runners.base import Runner
from .runners.torch_staged import torch_runner
from .weights import WeightSource, WeightTransform

GROWTH_FLAG_TEXT = (f"flag a block when the device's accumulated error grows more than {GROWTH_FLAG}x faster "
                    "through it than the reference's")
RUNTIMES = ("torch", "onnxruntime")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _dtype(name: str, option: str) -> torch.dtype:
    if name not in DTYPES:
        raise PortError(f"{option} {name!r} is not one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def validate(model: str | Path, *, device: str = "cpu", dtype: str | None = None, reference: str | None = None,
             golden_dtype: str | None = None, out: Path | None = None, resolution: int = 512, text_len: int = 512,
             timesteps: Sequence[float] = (1.0, 0.5, 0.1), seeds: Sequence[int] = (0,),
             base: Path | None = None, prompt: str | None = None, max_ratio: float = 2.0,
             config: Path | None = None, intrinsic: str | None = None,
             device_weight_transform: WeightTransform | None = None,
             prepare_device_model: Callable[[torch.nn.Module], None] | None = None,
             on_stage: Callable[[str, int], None] | None = None,
             runtime: str = "torch", provider: str = "CPUExecutionProvider",
             devices: str | Sequence[str] | None = None) -> Report:
    """Run golden, intrinsic reference and device under test in lock-step and judge the device.

    `runtime="torch"`: `model` is a transformer (folder or file) run on `device` in `dtype` (default bf16).
    `runtime="onnxruntime"`: `model` is an exported ONNX transformer folder run with `provider`; the golden and the
    intrinsic run use the source weights its export manifest names, `dtype` is the export's, and the golden defaults
    to fp64 for an fp32 export (an fp32 golden would make the intrinsic fp32 error zero).
    `device_weight_transform` and `prepare_device_model` act on the device-side torch model only (fault injection,
    or hooks for a custom attention backend).
    `devices` (two or more, e.g. `cuda:0,cuda:1`): the staged run split as pipeline stages over them with
    torch.distributed (validation.distributed); the report is the one a single-device run writes. Under torchrun,
    ranks other than 0 return None.
    """
    if devices is not None:
        if runtime != "torch":
            raise PortError(f"--devices with --runtime {runtime}: a pipeline over several devices runs the torch "
                            "staged runner; drop one of them.")
        if device != "cpu":
            raise PortError(f"--devices with --device {device}: give the devices once, in --devices.")
        from .distributed import validate_pipeline

        return validate_pipeline(model, devices=devices, dtype=dtype, reference=reference, golden_dtype=golden_dtype,
                                 out=out, resolution=resolution, text_len=text_len, timesteps=timesteps, seeds=seeds,
                                 base=base, prompt=prompt, max_ratio=max_ratio, config=config, intrinsic=intrinsic,
                                 device_weight_transform=device_weight_transform,
                                 prepare_device_model=prepare_device_model)
    reference = reference or "cpu"
    if runtime not in RUNTIMES:
        raise PortError(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}.")
    if intrinsic not in (None, "native", "emulated"):
        raise PortError(f"--intrinsic {intrinsic!r}: use native or emulated.")
    export: dict[str, Any] | None = None
    weights_path: str | Path = model
    if runtime == "onnxruntime":
        if device_weight_transform is not None or prepare_device_model is not None:
            raise PortError("weight transforms and model hooks act on a torch model; the onnxruntime runner has none.")
        from porting.export.ort import check_provider

        check_provider(provider)  # before any heavy loading: a missing provider is a usage error
        export, weights_path = _export_source(Path(model), dtype)
        dtype = export["dtype"]
    dtype = dtype or "bf16"
    golden_dtype = golden_dtype or ("fp64" if runtime == "onnxruntime" and dtype == "fp32" else "fp32")
    run_dtype, gold_dtype = _dtype(dtype, "--dtype"), _dtype(golden_dtype, "--golden-dtype")
    if gold_dtype.itemsize <= run_dtype.itemsize and dtype != "fp32":
        raise PortError(f"--golden-dtype {golden_dtype} must be more precise than --dtype {dtype}.")
    read_paths = {"model": model, "source transformer": weights_path, "--base": base, "--config": config}
    if out is not None:
        check_output(Path(out), verb="validate", replace="owned", inputs=read_paths)
    ref = resolve_device(reference)
    dev = resolve_device(device) if runtime == "torch" else None
    check_not_one_computation(dtype=dtype, golden_dtype=golden_dtype, device=dev, reference=ref, runtime=runtime)
    intrinsic = intrinsic or default_intrinsic(dev, ref, runtime)
    source = WeightSource(weights_path, config)
    if ref.type == "cpu":  # the golden and the intrinsic run live in host memory: refuse what cannot fit, up front
        check_validate_memory(source.config, [(k, shape) for k, shape, _ in source.plan.outputs()],
                              resolution=resolution, text_len=text_len, batch=len(seeds) * len(timesteps),
                              golden_dtype=golden_dtype, dtype=dtype,
                              text_encoder=Path(base) / "text_encoder" if base is not None and prompt else None)
    weights = source.weights_sha256()
    if export is not None and weights != export["weights_sha256"]:
        raise CheckFailed(f"{weights_path}: the source weights changed since the export (recorded "
                          f"{export['weights_sha256'][:16]}..., now {weights[:16]}...).",
                          hint="Export again from the current weights.")
    check_dequantized(source)
    inputs = build_inputs(source.config, resolution, text_len, timesteps, seeds, base, prompt)
    intrinsic_run = (torch_runner(source, ref, run_dtype) if intrinsic == "native" else
                     torch_runner(source, ref, torch.float32, emulate=run_dtype))
    if runtime == "onnxruntime":
        from .runners.onnxruntime import OrtRunner

        device_run: Runner = OrtRunner(Path(model), provider, run_dtype)
    else:
        device_run = torch_runner(source, dev, run_dtype, device_weight_transform)
    golden_weights = GoldenWeights()  # refuses a non-finite weight by name, counts all-zero ones
    runs = Runs(torch_runner(source, ref, gold_dtype, golden_weights), intrinsic_run, device_run)
    if prepare_device_model is not None:
        prepare_device_model(runs.device.model)  # type: ignore[attr-defined]
    report = judge(runs, source, inputs, dtype=dtype, golden_dtype=golden_dtype, model=model, max_ratio=max_ratio,
                   intrinsic=intrinsic, export=export, on_stage=on_stage, weights_sha256=weights,
                   golden_weights=golden_weights)
    if out is not None:
        report.write(Path(out), inputs=read_paths)
    return report


def default_intrinsic(device: torch.device | None, reference: torch.device, runtime: str) -> str:
    """emulated where the device under test is the reference CPU itself (a native intrinsic run there would be the
    device's own computation, ratio 1 by construction); native everywhere else."""
    if runtime == "torch" and device is not None and device == reference and reference.type == "cpu":
        return "emulated"
    return "native"


def same_computation(device: str | torch.device | None, reference: str | torch.device, runtime: str,
                     intrinsic: str, run_dtype: torch.dtype) -> bool:
    """Whether the intrinsic run is the device run itself (same device, same arithmetic): its ratio is 1 by
    construction and checks no device."""
    if runtime != "torch" or device is None or str(device) != str(reference):
        return False
    return intrinsic == "native" or run_dtype == torch.float32  # emulating fp32 rounding in fp32 is fp32 itself


BY_CONSTRUCTION = ("the intrinsic run is the device run itself ({why}): every ratio is 1 by construction and checks "
                   "no device; on a CPU, --intrinsic emulated (the default) measures the CPU's {dtype} kernels")


def _export_source(folder: Path, dtype: str | None) -> tuple[dict[str, Any], Path]:
    """The export manifest's facts and the source transformer it names, checked."""
    from porting.export.onnx import find_manifest

    root, manifest = find_manifest(folder)
    if folder.resolve() != (root / "transformer").resolve():
        raise PortError(f"{folder}: onnxruntime validation judges the transformer; pass {root / 'transformer'}.")
    if "transformer" not in manifest.get("components", {}):
        raise InputError(f"{root}: this export has no transformer component.")
    src = (manifest.get("source") or {}).get("transformer")
    if not src or not Path(src).is_dir():
        raise InputError(f"{root}: the source transformer {src} the export names is not there; the golden runs on it.",
                         hint="Keep the source folder where it was exported from, or export again.")
    if dtype is not None and dtype != manifest["dtype"]:
        raise PortError(f"--dtype {dtype}: this export is {manifest['dtype']}; leave --dtype out for onnxruntime.")
    facts = {"folder": str(root.resolve()), "dtype": manifest["dtype"], "opset": manifest.get("opset"),
             "weights_sha256": manifest["source"]["weights_sha256"], "source": src}
    return facts, Path(src)


@dataclass
class RunFacts:
    """What the report says about where the runs happened (one device, or a pipeline over several)."""
    device: str
    reference: str
    device_type: str | None
    reference_type: str
    facts_device: dict[str, Any]
    facts_reference: dict[str, Any]
    runtime: str
    localises: bool
    localisation_note: str

    @classmethod
    def of(cls, runs: Runs) -> "RunFacts":
        dev, ref = runs.device.device, runs.golden.device
        return cls(str(dev), str(ref), getattr(dev, "type", None), ref.type, runs.device.facts(), runs.golden.facts(),
                   runs.device.runtime, runs.device.localises, runs.device.localisation_note)


def judge(runs: Runs, source: WeightSource, inputs: Inputs, *, dtype: str, golden_dtype: str, model: str | Path,
          max_ratio: float, intrinsic: str, export: dict[str, Any] | None = None,
          on_stage: Callable[[str, int], None] | None = None, weights_sha256: str | None = None,
          golden_weights: GoldenWeights | None = None) -> Report:
    """Run the lock-step comparison and apply the verdict rule; the same for every runner.

    Raises `Unmeasurable` (exit 2) instead of judging when nothing was measured (validation.checks)."""
    total = len(runs.golden.stage_names()) + (0 if runs.device.localises else 1)
    rows, outputs = lockstep(runs, inputs.state,
                             (lambda s: on_stage(s, total)) if on_stage else None)
    return verdict(rows, outputs, RunFacts.of(runs), source, inputs, dtype=dtype, golden_dtype=golden_dtype,
                   model=model, max_ratio=max_ratio, intrinsic=intrinsic, export=export,
                   weights_sha256=weights_sha256, golden_weights=golden_weights)


def verdict(rows: list[dict[str, Any]], outputs: dict[str, torch.Tensor], where: RunFacts, source: WeightSource,
            inputs: Inputs, *, dtype: str, golden_dtype: str, model: str | Path, max_ratio: float, intrinsic: str,
            export: dict[str, Any] | None = None, weights_sha256: str | None = None,
            golden_weights: GoldenWeights | None = None, extra: dict[str, Any] | None = None) -> Report:
    """The report from the lock-step rows and final outputs, wherever they were computed (validation.distributed
    gathers them from its ranks and calls this on rank 0)."""
    run_dtype = _dtype(dtype, "--dtype")
    table = source.detection.table
    for row in rows:
        row["original"] = original_name(table, row["stage"])

    overall_dev = compare(outputs["device"], outputs["golden"], run_dtype)
    overall_int = compare(outputs["intrinsic"], outputs["golden"], run_dtype)
    check_measurable(outputs["golden"], overall_dev, overall_int, dtype=dtype, golden_dtype=golden_dtype,
                     weights=golden_weights)
    ratio = error_ratio(overall_dev["rel_l2"], overall_int["rel_l2"], run_dtype)
    summary = [{"name": "all cases", "device_error": overall_dev["rel_l2"], "intrinsic_error": overall_int["rel_l2"],
                "ratio": ratio, "cosine": overall_dev["cosine"]}]
    for i, case in enumerate(inputs.cases):
        d = compare(outputs["device"][i], outputs["golden"][i], run_dtype)
        r = compare(outputs["intrinsic"][i], outputs["golden"][i], run_dtype)
        summary.append({"name": f"seed {case['seed']}, t={case['timestep']}", "device_error": d["rel_l2"],
                        "intrinsic_error": r["rel_l2"], "ratio": error_ratio(d["rel_l2"], r["rel_l2"], run_dtype),
                        "cosine": d["cosine"]})

    reasons: list[str] = []
    nonfinite = [r["stage"] for r in rows if r["accumulated"]["device"]["nonfinite"]
                 or r["teacher_forced"]["device"]["nonfinite"]]
    if nonfinite:
        reasons.append(f"NaN/Inf on the device, first in {nonfinite[0]}")
    elif overall_dev["nonfinite"]:
        reasons.append(f"NaN/Inf in the device's output ({overall_dev['nonfinite']} element(s))")
    if ratio > max_ratio:
        reasons.append(f"final output error {100 * overall_dev['rel_l2']:.3g} % is {ratio:.2f}x the intrinsic "
                       f"{dtype} error "
                       f"{100 * overall_int['rel_l2']:.3g} % (limit {max_ratio}x)")
    blame_row = next((r for r in rows if r["teacher_forced"]["device"]["nonfinite"]
                      or r["teacher_forced"]["ratio"] > max_ratio), None)
    blame = None
    if blame_row is not None:
        tf = blame_row["teacher_forced"]
        why = ("produces NaN/Inf from golden inputs" if tf["device"]["nonfinite"] else
               f"own error {100 * tf['device']['rel_l2']:.3g} % is {tf['ratio']:.2f}x the intrinsic "
               f"{100 * tf['intrinsic']['rel_l2']:.3g} %")
        blame = {"stage": blame_row["stage"], "original": blame_row["original"], "ratio": tf["ratio"], "reason": why}
        reasons.append(f"first bad block: {blame['stage']} (= {blame['original']}): {why}")
    growth = [r["stage"] for r in rows if r["growth_flag"]]

    known = []
    facts_dev, facts_ref = where.facts_device, where.facts_reference
    if facts_dev.get("rope_freqs_dtype", facts_ref["rope_freqs_dtype"]) != facts_ref["rope_freqs_dtype"]:
        known.append(f"diffusers computes RoPE frequencies in {facts_dev['rope_freqs_dtype']} on {where.device_type} "
                     f"but in {facts_ref['rope_freqs_dtype']} on {where.reference_type}; both then cast cos/sin to "
                     "float32.")
    if where.device_type == "npu":
        known.append("attention may run through torch_npu.npu_fusion_attention (diffusers _native_npu backend) "
                     "instead of PyTorch SDPA; ACL_PRECISION_MODE and HF32 settings are recorded in environment.")

    by_construction = same_computation(where.device, where.reference, where.runtime, intrinsic, run_dtype)
    notices = [BY_CONSTRUCTION.format(why=f"--intrinsic {intrinsic} on {where.reference}, the device under test",
                                      dtype=dtype)] if by_construction else []
    data: dict[str, Any] = {
        "tool": "flux-port", "version": __version__, "format_version": 1, "kind": "validation",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {"path": str(Path(model).resolve()), "naming": source.detection.naming_label,
                  "variant": source.detection.variant, "table": table.name,
                  "config": {k: v for k, v in source.config.items() if not k.startswith("_")},
                  **source.provenance()},
        "weights_sha256": weights_sha256 or source.weights_sha256(),
        "device": where.device, "dtype": dtype, "reference": where.reference, "golden_dtype": golden_dtype,
        "intrinsic": intrinsic,
        "intrinsic_run": (f"{dtype} on {where.reference}" if intrinsic == "native" else
                          f"float32 arithmetic on {where.reference} with {dtype} rounding of weights, inputs and every "
                          "module output"),
        "ratio_by_construction": by_construction, "notices": notices,
        "runtime": where.runtime,
        "localisation": {"per_block": where.localises,
                         "note": None if where.localises else where.localisation_note},
        "environment": {"device": facts_dev, "reference": facts_ref},
        "inputs": inputs.description, "cases": inputs.cases,
        "rule": {"metric": "relative L2 error against the golden", "max_ratio": max_ratio,
                 "denominator_floor": error_floor(run_dtype), "growth_flag": GROWTH_FLAG_TEXT,
                 "statement": f"pass iff no NaN/Inf, the final output's error is at most {max_ratio}x the intrinsic "
                              f"{dtype} error (same model in {dtype} on {where.reference})"
                              + (f", and no block's teacher-forced error exceeds {max_ratio}x its intrinsic error"
                                 if where.localises else " (final output only: no per-block check)")},
        "output": {"device": overall_dev, "intrinsic": overall_int, "ratio": ratio},
        "summary": summary, "blocks": rows, "blame": blame, "growth_flags": growth,
        "known_differences": known,
        "verdict": "fail" if reasons else "pass", "reasons": reasons,
    }
    data.update(extra or {})
    if export is not None:
        data["export"] = export
        known.append("onnxruntime fuses, reorders and re-implements operations (its own GEMM and attention kernels), "
                     "so its error differs from torch's in the same dtype; the ratio rule judges that difference.")
    return Report(data)

