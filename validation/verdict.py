"""The verdict: from the lock-step rows and the final outputs of the golden, intrinsic and device runs, wherever
they were computed (one process, or the ranks of validation.distributed), to the report and its rule."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from porting import __version__
from porting.errors import PortError

from .checks import GoldenWeights, check_measurable
from .compare import GROWTH_FLAG, Runs
from .inputs import Inputs
from .metrics import compare, error_floor, error_ratio
from .report import Report, original_name
from .weights import WeightSource

GROWTH_FLAG_TEXT = (f"flag a block when the device's accumulated error grows more than {GROWTH_FLAG}x faster "
                    "through it than the reference's")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _dtype(name: str, option: str) -> torch.dtype:
    if name not in DTYPES:
        raise PortError(f"{option} {name!r} is not one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def same_computation(device: str | torch.device | None, reference: str | torch.device, runtime: str,
                     intrinsic: str, run_dtype: torch.dtype) -> bool:
    """Whether the intrinsic run is the device run itself (same device, same arithmetic): its ratio is 1 by
    construction and checks no device."""
    if runtime != "torch" or device is None or str(device) != str(reference):
        return False
    return intrinsic == "native" or run_dtype == torch.float32  # emulating fp32 rounding in fp32 is fp32 itself


BY_CONSTRUCTION = ("the intrinsic run is the device run itself ({why}): every ratio is 1 by construction and checks "
                   "no device; on a CPU, --intrinsic emulated (the default) measures the CPU's {dtype} kernels")


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


def verdict(rows: list[dict[str, Any]], outputs: dict[str, torch.Tensor], where: RunFacts, source: WeightSource,
            inputs: Inputs, *, dtype: str, golden_dtype: str, model: str | Path, max_ratio: float, intrinsic: str,
            export: dict[str, Any] | None = None, weights_sha256: str | None = None,
            golden_weights: GoldenWeights | None = None, extra: dict[str, Any] | None = None) -> Report:
    """The report from the lock-step rows and final outputs, wherever they were computed (validation.distributed
    gathers them from its ranks and calls this on rank 0)."""
    run_dtype = _dtype(dtype, "--dtype")
    table = source.detection.table
    for row in rows:
        row["original"] = original_name(table, row["stage"], source.stages.labels)

    overall_dev = compare(outputs["device"], outputs["golden"], run_dtype)
    overall_int = compare(outputs["intrinsic"], outputs["golden"], run_dtype)
    check_measurable(outputs["golden"], overall_dev, overall_int, dtype=dtype, golden_dtype=golden_dtype,
                     weights=golden_weights)
    ratio = error_ratio(overall_dev["rel_l2"], overall_int["rel_l2"], run_dtype)
    summary = _summary(outputs, inputs, run_dtype, overall_dev, overall_int, ratio)
    reasons, blame = _reasons(rows, overall_dev, overall_int, ratio, max_ratio, dtype)
    growth = [r["stage"] for r in rows if r["growth_flag"]]

    known = _known_differences(where)
    facts_dev, facts_ref = where.facts_device, where.facts_reference
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
        if export.get("ran"):
            known.append(f"what onnxruntime ran: {export['ran']}; the intrinsic error is the same bf16 rounding of "
                         "the weights applied in torch (float32 compute).")
        known.append("onnxruntime fuses, reorders and re-implements operations (its own GEMM and attention kernels), "
                     "so its error differs from torch's in the same dtype; the ratio rule judges that difference.")
    return Report(data)


def _summary(outputs: dict[str, torch.Tensor], inputs: Inputs, run_dtype: torch.dtype, overall_dev: dict[str, Any],
             overall_int: dict[str, Any], ratio: float) -> list[dict[str, Any]]:
    """The summary rows: all cases together, then each case (seed and timestep)."""
    summary = [{"name": "all cases", "device_error": overall_dev["rel_l2"], "intrinsic_error": overall_int["rel_l2"],
                "ratio": ratio, "cosine": overall_dev["cosine"]}]
    for i, case in enumerate(inputs.cases):
        d = compare(outputs["device"][i], outputs["golden"][i], run_dtype)
        r = compare(outputs["intrinsic"][i], outputs["golden"][i], run_dtype)
        summary.append({"name": f"seed {case['seed']}, t={case['timestep']}", "device_error": d["rel_l2"],
                        "intrinsic_error": r["rel_l2"], "ratio": error_ratio(d["rel_l2"], r["rel_l2"], run_dtype),
                        "cosine": d["cosine"]})
    return summary


def _reasons(rows: list[dict[str, Any]], overall_dev: dict[str, Any], overall_int: dict[str, Any], ratio: float,
             max_ratio: float, dtype: str) -> tuple[list[str], dict[str, Any] | None]:
    """Why the device fails (empty: it passes), and the first bad block (teacher-forced), if any."""
    reasons: list[str] = []
    nonfinite = [r["stage"] for r in rows if r["accumulated"]["device"]["nonfinite"]
                 or r["teacher_forced"]["device"]["nonfinite"]]
    if nonfinite:
        reasons.append(f"NaN/Inf on the device, first in {nonfinite[0]}")
    elif overall_dev["nonfinite"]:
        reasons.append(f"NaN/Inf in the device's output ({overall_dev['nonfinite']} element(s))")
    if ratio > max_ratio:
        reasons.append(f"final output error {100 * overall_dev['rel_l2']:.3g} % is {ratio:.2f}x the intrinsic "
                       f"{dtype} error {100 * overall_int['rel_l2']:.3g} % (limit {max_ratio}x)")
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
    return reasons, blame


def _known_differences(where: RunFacts) -> list[str]:
    """Differences between the device's and the reference's computation that are known and by design."""
    known = []
    facts_dev, facts_ref = where.facts_device, where.facts_reference
    if facts_dev.get("rope_freqs_dtype", facts_ref["rope_freqs_dtype"]) != facts_ref["rope_freqs_dtype"]:
        known.append(f"diffusers computes RoPE frequencies in {facts_dev['rope_freqs_dtype']} on {where.device_type} "
                     f"but in {facts_ref['rope_freqs_dtype']} on {where.reference_type}; both then cast cos/sin to "
                     "float32.")
    if where.device_type == "npu":
        known.append("attention may run through torch_npu.npu_fusion_attention (diffusers _native_npu backend) "
                     "instead of PyTorch SDPA; ACL_PRECISION_MODE and HF32 settings are recorded in environment.")
    return known
