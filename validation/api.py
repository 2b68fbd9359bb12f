"""`validate()`: the whole check of one transformer on one device, producing a Report."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from porting.devices import parse_device, resolve_device
from porting.errors import CheckFailed, InputError, PortError
from porting.outputs import check_output

from .checks import GoldenWeights, check_dequantized, check_not_one_computation
from .compare import Runs, lockstep
from .inputs import Inputs, build_inputs
from .memory import check_devices, check_host, request_for
from .options import RUNTIMES, check_applicable
from .report import Report
from .runners.base import Runner
from .runners.torch_staged import torch_runner
from .verdict import DTYPES, RunFacts, _dtype, verdict  # noqa: F401  (DTYPES: re-exported)
from .weights import WeightSource, WeightTransform


def validate(model: str | Path, *, device: str = "cpu", dtype: str | None = None, reference: str | None = None,
             golden_dtype: str | None = None, out: Path | None = None, resolution: int = 512, text_len: int = 512,
             timesteps: Sequence[float] = (1.0, 0.5, 0.1), seeds: Sequence[int] = (0,),
             base: Path | None = None, prompt: str | None = None, max_ratio: float = 2.0,
             config: Path | None = None, intrinsic: str | None = None,
             device_weight_transform: WeightTransform | None = None,
             prepare_device_model: Callable[[torch.nn.Module], None] | None = None,
             on_stage: Callable[[str, int], None] | None = None,
             runtime: str = "torch", provider: str = "CPUExecutionProvider",
             devices: str | Sequence[str] | None = None, svdq_compute: str | None = None,
             ort_threads: int | None = None, text_encoder: Path | None = None) -> Report:
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
    `ort_threads`: onnxruntime's intra-op threads (its sessions open lean: `porting.export.ort.SessionSettings`).
    `svdq_compute` ("w4a4" or "w4a16", a Nunchaku SVDQuant `model` only): the intrinsic and device runs keep the
    quantized linears packed and compute them so (validation.packed); the golden stays the float32 run of the
    dequantized weights. Without it an SVDQuant file runs as plain linears of its dequantized weights.
    `text_encoder` (a 4-bit file, with `base` and `prompt`) encodes the prompt, packed, in place of the base's
    encoder; the report's inputs give its features' error."""
    _check_options(runtime, device, devices, ort_threads, svdq_compute,
                   device_weight_transform is not None or prepare_device_model is not None, text_encoder, prompt, base)
    te_source = _open_text_encoder(text_encoder, base)
    if devices is not None:
        from .distributed import validate_pipeline

        return validate_pipeline(model, devices=devices, dtype=dtype, reference=reference, golden_dtype=golden_dtype,
                                 out=out, resolution=resolution, text_len=text_len, timesteps=timesteps, seeds=seeds,
                                 base=base, prompt=prompt, max_ratio=max_ratio, config=config, intrinsic=intrinsic,
                                 device_weight_transform=device_weight_transform,
                                 prepare_device_model=prepare_device_model)
    if intrinsic not in (None, "native", "emulated"):
        raise PortError(f"--intrinsic {intrinsic!r}: use native or emulated.")
    export: dict[str, Any] | None = None
    weights_path: str | Path = model
    if runtime == "onnxruntime":
        from porting.export.ort import SessionSettings, check_provider

        check_provider(provider)  # before any heavy loading: a missing provider is a usage error
        if _is_text_encoder_export(Path(model)):
            from .text_encoder import validate_text_encoder

            return validate_text_encoder(Path(model), out=out, max_ratio=max_ratio, provider=provider,
                                         prompt=prompt, settings=SessionSettings(threads=ort_threads))
        export, weights_path = _export_source(Path(model), dtype)
        dtype = export["dtype"]
        if export.get("target") == "ryzenai":  # a static graph: its size and text length are the inputs
            resolution, text_len = ryzenai_size(export, resolution), export["profile"]["text_len"]
    dtype, golden_dtype = _dtypes(dtype, golden_dtype, runtime)
    read_paths = {"model": model, "source transformer": weights_path, "--base": base, "--config": config}
    if out is not None:
        check_output(Path(out), verb="validate", replace="owned", inputs=read_paths)
    source = WeightSource(weights_path, config)
    ref, dev = _devices(source, reference or "cpu", device, runtime, dtype, golden_dtype, export, Path(model),
                        provider, resolution, text_len, len(seeds) * len(timesteps), base, prompt)
    intrinsic = intrinsic or default_intrinsic(dev, ref, runtime)
    weights = source.weights_sha256()
    if export is not None and weights != export["weights_sha256"]:
        raise _changed_since_export(weights_path, export["weights_sha256"], weights)
    check_dequantized(source)
    inputs = build_inputs(source.config, resolution, text_len, timesteps, seeds, base, prompt,
                          family=source.detection.family, text_encoder=_packed(te_source))
    runs, golden_weights = _runs(source, ref, dev, dtype, golden_dtype, intrinsic, export, svdq_compute,
                                 device_weight_transform, Path(model), provider, resolution, ort_threads)
    if prepare_device_model is not None:
        prepare_device_model(runs.device.model)  # type: ignore[attr-defined]
    report = judge(runs, source, inputs, dtype=dtype, golden_dtype=golden_dtype, model=model, max_ratio=max_ratio,
                   intrinsic=intrinsic, export=export, on_stage=on_stage, weights_sha256=weights,
                   golden_weights=golden_weights)
    if out is not None:
        report.write(Path(out), inputs=read_paths)
    return report


def _open_text_encoder(text_encoder: Path | None, base: Path | None) -> Any:
    """--text-encoder opened and checked against --base (which --prompt needs: checked before), or None."""
    if text_encoder is None:
        return None
    from porting.pipeline.text_encoder_swap import open_swap

    return open_swap(Path(base), Path(text_encoder))  # type: ignore[arg-type]


def _packed(te_source: Any) -> Any:
    """The 4-bit text encoder run packed on the CPU in float32 (the golden's precision), or None."""
    if te_source is None:
        return None
    from porting.runtime.awq_text import load_packed_text_encoder

    return load_packed_text_encoder(te_source, "cpu", torch.float32)


def _check_options(runtime: str, device: str, devices: str | Sequence[str] | None, ort_threads: int | None,
                   svdq_compute: str | None, hooks: bool, text_encoder: Path | None = None,
                   prompt: str | None = None, base: Path | None = None) -> None:
    """--runtime is one validate knows, and every option given applies to the run (`options.APPLIES`)."""
    if runtime not in RUNTIMES and devices is None:
        raise PortError(f"--runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}.")
    check_applicable(runtime, {"--device": None if device == "cpu" else device, "--ort-threads": ort_threads,
                               "--svdq-compute": svdq_compute, "--devices": devices, "hooks": hooks or None,
                               "--text-encoder": text_encoder, "--prompt": prompt, "--base": base},
                     device=device, devices=devices if devices is None or isinstance(devices, str) else
                     ",".join(devices), ort_threads=ort_threads)


def _changed_since_export(weights_path: str | Path, recorded: str, now: str) -> CheckFailed:
    return CheckFailed(f"{weights_path}: the source weights changed since the export (recorded {recorded[:16]}..., "
                       f"now {now[:16]}...).", hint="Export again from the current weights.")


def _dtypes(dtype: str | None, golden_dtype: str | None, runtime: str) -> tuple[str, str]:
    """--dtype and --golden-dtype with their defaults (fp64 golden for an fp32 ONNX export), the golden checked to be
    the more precise."""
    dtype = dtype or "bf16"
    golden_dtype = golden_dtype or ("fp64" if runtime == "onnxruntime" and dtype == "fp32" else "fp32")
    if _dtype(golden_dtype, "--golden-dtype").itemsize <= _dtype(dtype, "--dtype").itemsize and dtype != "fp32":
        raise PortError(f"--golden-dtype {golden_dtype} must be more precise than --dtype {dtype}.")
    return dtype, golden_dtype


def _devices(source: WeightSource, reference: str, device: str, runtime: str, dtype: str, golden_dtype: str,
             export: dict[str, Any] | None, model: Path, provider: str, resolution: int, text_len: int, batch: int,
             base: Path | None, prompt: str | None) -> tuple[torch.device, torch.device | None]:
    """The reference device and the device under test (None for onnxruntime), each checked to hold the run.

    The host's share first, from the options and the headers alone, before any backend is imported or device probed
    (docs/validate.md, "Memory": why this order); then each accelerator's free memory, once it is there."""
    ref_spec = parse_device(reference)
    dev_spec = parse_device(device) if runtime == "torch" else None
    check_not_one_computation(dtype=dtype, golden_dtype=golden_dtype, device=dev_spec, reference=ref_spec,
                              runtime=runtime)
    need = request_for(source, reference=ref_spec.type, device=dev_spec.type if dev_spec else None,
                       resolution=resolution, text_len=text_len, batch=batch,
                       golden_dtype=golden_dtype, dtype=dtype, base=base, prompt=prompt,
                       session=_cpu_session_graph(model, export, provider, resolution) if export else None)
    check_host(need)
    ref = resolve_device(reference, "--reference")
    dev = resolve_device(device) if runtime == "torch" else None
    check_devices(need, ref, dev)
    return ref, dev


def _runs(source: WeightSource, ref: torch.device, dev: torch.device | None, dtype: str, golden_dtype: str,
          intrinsic: str, export: dict[str, Any] | None, svdq_compute: str | None,
          device_weight_transform: WeightTransform | None, model: Path, provider: str, resolution: int,
          ort_threads: int | None) -> tuple[Runs, GoldenWeights]:
    """The golden, intrinsic and device runners (and, for packed SVDQuant linears, the plain golden too)."""
    run_dtype, gold_dtype = _dtype(dtype, "--dtype"), _dtype(golden_dtype, "--golden-dtype")
    packed = None
    if svdq_compute is not None:
        from .packed import PackedLinears

        packed = PackedLinears(source, svdq_compute)
    if export is not None and export.get("target") == "ryzenai":
        # the export computes in float32 on bf16-rounded weights (Cast nodes): its intrinsic error is that rounding
        from porting.export.ryzenai import torch_bf16_weights

        intrinsic_run = torch_runner(source, ref, torch.float32, torch_bf16_weights)
    else:
        intrinsic_run = (torch_runner(source, ref, run_dtype, packed=packed) if intrinsic == "native" else
                         torch_runner(source, ref, torch.float32, emulate=run_dtype, packed=packed))
    if dev is None:
        from porting.export.ort import SessionSettings

        from .runners.onnxruntime import OrtRunner

        device_run: Runner = OrtRunner(model, provider, run_dtype, source.stages.forward_kwargs,
                                       graph=(export or {}).get("graphs", {}).get(str(resolution)),
                                       settings=SessionSettings(threads=ort_threads))
    else:
        device_run = torch_runner(source, dev, run_dtype, device_weight_transform, packed=packed)
    golden_weights = GoldenWeights()  # refuses a non-finite weight by name, counts all-zero ones
    if packed is not None:  # the verdict: the device's packed run against the same computation on the reference
        return Runs(torch_runner(source, ref, gold_dtype, golden_weights, packed=packed), intrinsic_run, device_run,
                    plain=torch_runner(source, ref, gold_dtype)), golden_weights
    return Runs(torch_runner(source, ref, gold_dtype, golden_weights), intrinsic_run, device_run), golden_weights


def _cpu_session_graph(folder: Path, export: dict[str, Any], provider: str, resolution: int) -> Path | None:
    """The graph an onnxruntime session opens in host memory (the CPU provider's), for the memory estimate."""
    from porting.export.ort import model_path

    if provider != "CPUExecutionProvider":
        return None
    return model_path(folder, export.get("graphs", {}).get(str(resolution)))


def ryzenai_size(export: dict[str, Any], resolution: int) -> int:
    """The static size a ryzenai transformer export is validated at: `resolution` when the export has a graph for
    it (several --size values), else its first size (the graphs take no other)."""
    sizes = export["profile"].get("sizes") or [export["profile"]["size"]]
    return resolution if resolution in sizes else int(sizes[0])


def _is_text_encoder_export(folder: Path) -> bool:
    from porting.export.onnx import MANIFEST

    return folder.name == "text_encoder" and (folder.parent / MANIFEST).is_file()


def default_intrinsic(device: torch.device | None, reference: torch.device, runtime: str) -> str:
    """emulated where the device under test is the reference CPU itself (a native intrinsic run there would be the
    device's own computation, ratio 1 by construction); native everywhere else."""
    if runtime == "torch" and device is not None and device == reference and reference.type == "cpu":
        return "emulated"
    return "native"


def _export_source(folder: Path, dtype: str | None) -> tuple[dict[str, Any], Path]:
    """The export manifest's facts and the source transformer it names, checked."""
    from porting.export.identity import check
    from porting.export.onnx import find_manifest

    root, manifest = find_manifest(folder)
    if folder.resolve() != (root / "transformer").resolve():
        raise PortError(f"{folder}: onnxruntime validation judges the transformer; pass {root / 'transformer'}.")
    check(root, manifest, own=False)  # the export's own graph is what validate judges
    if "transformer" not in manifest.get("components", {}):
        raise InputError(f"{root}: this export has no transformer component.")
    src = manifest["source"].get("transformer")
    if not isinstance(src, str) or not isinstance(manifest["source"].get("weights_sha256"), str):
        raise InputError(f"{root}: the export manifest's 'source' names no transformer folder and weights hash.",
                         hint="The manifest is damaged or hand-edited; export again.")
    if not src or not Path(src).is_dir():
        raise InputError(f"{root}: the source transformer {src} the export names is not there; the golden runs on it.",
                         hint="Keep the source folder where it was exported from, or export again.")
    if dtype is not None and dtype != manifest["dtype"]:
        raise PortError(f"--dtype {dtype}: this export is {manifest['dtype']}; leave --dtype out for onnxruntime.")
    facts = {"folder": str(root.resolve()), "dtype": manifest["dtype"], "opset": manifest.get("opset"),
             "weights_sha256": manifest["source"]["weights_sha256"], "source": src}
    if manifest.get("target") == "ryzenai":
        graphs = manifest["components"]["transformer"].get("graphs") or {}
        facts.update(target="ryzenai", profile=manifest["profile"],
                     graphs={size: Path(g["file"]).name for size, g in graphs.items()},
                     ran=("bf16 weights (initializers stored as bfloat16) cast to float32 by the graph's Cast nodes, "
                          "float32 compute: onnxruntime's CPU provider has no bf16 MatMul; the NPU computes in bf16"))
    return facts, Path(src)


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
