"""`validate()`: the whole check of one transformer on one device, producing a Report."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from porting import __version__
from porting.devices import device_facts, resolve_device
from porting.errors import PortError
from porting.outputs import check_output

from .compare import GROWTH_FLAG, Runs, lockstep
from .inputs import build_inputs
from .metrics import compare, error_floor, error_ratio
from .report import Report, original_name
from .staged import StagedFlux2
from .weights import WeightSource, WeightTransform

GROWTH_FLAG_TEXT = (f"flag a block when the device's accumulated error grows more than {GROWTH_FLAG}x faster "
                    "through it than the reference's")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


def _dtype(name: str, option: str) -> torch.dtype:
    if name not in DTYPES:
        raise PortError(f"{option} {name!r} is not one of {', '.join(DTYPES)}.")
    return DTYPES[name]


def validate(model: str | Path, *, device: str = "cpu", dtype: str = "bf16", reference: str = "cpu",
             golden_dtype: str = "fp32", out: Path | None = None, resolution: int = 512, text_len: int = 512,
             timesteps: Sequence[float] = (1.0, 0.5, 0.1), seeds: Sequence[int] = (0,),
             base: Path | None = None, prompt: str | None = None, max_ratio: float = 2.0,
             config: Path | None = None, intrinsic: str = "native",
             device_weight_transform: WeightTransform | None = None,
             prepare_device_model: Callable[[torch.nn.Module], None] | None = None,
             on_stage: Callable[[str, int], None] | None = None) -> Report:
    """Run golden, intrinsic reference and device under test in lock-step and judge the device.

    `device_weight_transform` and `prepare_device_model` act on the device-side model only (fault injection,
    or hooks for a custom attention backend).
    """
    run_dtype, gold_dtype = _dtype(dtype, "--dtype"), _dtype(golden_dtype, "--golden-dtype")
    if gold_dtype.itemsize <= run_dtype.itemsize and dtype != "fp32":
        raise PortError(f"--golden-dtype {golden_dtype} must be more precise than --dtype {dtype}.")
    if intrinsic not in ("native", "emulated"):
        raise PortError(f"--intrinsic {intrinsic!r}: use native or emulated.")
    if out is not None:
        check_output(Path(out), verb="validate", replace="owned", inputs={"model": model})
    dev, ref = resolve_device(device), resolve_device(reference)
    source = WeightSource(model, config)
    inputs = build_inputs(source.config, resolution, text_len, timesteps, seeds, base, prompt)
    intrinsic_run = (StagedFlux2(source, ref, run_dtype) if intrinsic == "native" else
                     StagedFlux2(source, ref, torch.float32, emulate=run_dtype))
    runs = Runs(StagedFlux2(source, ref, gold_dtype), intrinsic_run,
                StagedFlux2(source, dev, run_dtype, device_weight_transform))
    if prepare_device_model is not None:
        prepare_device_model(runs.device.model)
    total = len(runs.golden.stage_names())
    rows, outputs = lockstep(runs, inputs.state,
                             (lambda s: on_stage(s, total)) if on_stage else None)
    table = source.detection.table
    for row in rows:
        row["original"] = original_name(table, row["stage"])

    overall_dev = compare(outputs["device"], outputs["golden"], run_dtype)
    overall_int = compare(outputs["intrinsic"], outputs["golden"], run_dtype)
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
    if ratio > max_ratio:
        reasons.append(f"final output error {overall_dev['rel_l2']:.3%} is {ratio:.2f}x the intrinsic {dtype} error "
                       f"{overall_int['rel_l2']:.3%} (limit {max_ratio}x)")
    blame_row = next((r for r in rows if r["teacher_forced"]["device"]["nonfinite"]
                      or r["teacher_forced"]["ratio"] > max_ratio), None)
    blame = None
    if blame_row is not None:
        tf = blame_row["teacher_forced"]
        why = ("produces NaN/Inf from golden inputs" if tf["device"]["nonfinite"] else
               f"own error {tf['device']['rel_l2']:.3%} is {tf['ratio']:.2f}x the intrinsic "
               f"{tf['intrinsic']['rel_l2']:.3%}")
        blame = {"stage": blame_row["stage"], "original": blame_row["original"], "ratio": tf["ratio"], "reason": why}
        reasons.append(f"first bad block: {blame['stage']} (= {blame['original']}): {why}")
    growth = [r["stage"] for r in rows if r["growth_flag"]]

    known = []
    facts_dev, facts_ref = device_facts(dev), device_facts(ref)
    if facts_dev["rope_freqs_dtype"] != facts_ref["rope_freqs_dtype"]:
        known.append(f"diffusers computes RoPE frequencies in {facts_dev['rope_freqs_dtype']} on {dev.type} but in "
                     f"{facts_ref['rope_freqs_dtype']} on {ref.type}; both then cast cos/sin to float32.")
    if dev.type == "npu":
        known.append("attention may run through torch_npu.npu_fusion_attention (diffusers _native_npu backend) "
                     "instead of PyTorch SDPA; ACL_PRECISION_MODE and HF32 settings are recorded in environment.")

    data: dict[str, Any] = {
        "tool": "flux-port", "version": __version__, "kind": "validation",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": {"path": str(Path(model).resolve()), "naming": source.detection.naming_label,
                  "variant": source.detection.variant, "table": table.name,
                  "config": {k: v for k, v in source.config.items() if not k.startswith("_")},
                  **source.provenance()},
        "weights_sha256": source.weights_sha256(),
        "device": str(dev), "dtype": dtype, "reference": str(ref), "golden_dtype": golden_dtype,
        "intrinsic": intrinsic if intrinsic == "native" else f"emulated ({dtype} rounding of weights, inputs and every "
                                                             "module output, float32 arithmetic)",
        "environment": {"device": facts_dev, "reference": facts_ref},
        "inputs": inputs.description, "cases": inputs.cases,
        "rule": {"metric": "relative L2 error against the golden", "max_ratio": max_ratio,
                 "denominator_floor": error_floor(run_dtype), "growth_flag": GROWTH_FLAG_TEXT,
                 "statement": f"pass iff no NaN/Inf, the final output's error is at most {max_ratio}x the intrinsic "
                              f"{dtype} error (same model in {dtype} on {ref}), and no block's teacher-forced error "
                              f"exceeds {max_ratio}x its intrinsic error"},
        "output": {"device": overall_dev, "intrinsic": overall_int, "ratio": ratio},
        "summary": summary, "blocks": rows, "blame": blame, "growth_flags": growth,
        "known_differences": known,
        "verdict": "fail" if reasons else "pass", "reasons": reasons,
    }
    report = Report(data)
    if out is not None:
        report.write(Path(out), inputs={"model": model})
    return report

