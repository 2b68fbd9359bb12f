"""`port validate MODEL --device npu:0`: is the port right on this device, and if not, where does it go wrong."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from porting.errors import CheckFailed

from . import _output
from ._options import (
    JsonOpt,
    OrtThreadsOpt,
    QuietOpt,
    SvdqCompute,
    WorkspaceOpt,
    device_option,
    out_option,
    transformer_of,
)

VALIDATE_EXAMPLES = """\b
Examples:
  port validate ./transformer --device npu:0
  port validate Flux2-Klein-9B-True-bf16.safetensors --device cuda --resolution 1024 --seeds 0,1
  port validate ./transformer --device npu:0 --base ./FLUX.2-klein-9B --prompt "a red fox in snow"
  port validate flux2-klein-9b-true-v1 --device npu:0 --prompt "a red fox in snow"   (a recipe's workspace)
  port validate ./klein-onnx/transformer --runtime onnxruntime --provider CUDAExecutionProvider
  port validate ./transformer --devices npu:0,npu:1              (pipeline stages over two NPUs)
  torchrun --nproc-per-node 2 -m porting validate ./transformer --devices cuda:0,cuda:1
"""


# long: the signature is validate's table of 24 options (each with its help); the body is 32 lines
def validate(
    model: Annotated[Path, typer.Argument(help="Converted diffusers transformer folder, an original-naming file, or a "
                                          "recipe name in the workspace.")],
    device: Annotated[Optional[str], typer.Option(
        "--device", help="Device under test: cpu, cuda[:N], npu[:N], mps, xpu[:N] (default cpu; not with "
                         "--devices).")] = None,
    devices: Annotated[Optional[str], typer.Option(
        "--devices", help="Two or more devices of one type (cuda:0,cuda:1; npu:0,npu:1; cpu,cpu): the staged run "
                          "split as pipeline stages over them (torch.distributed; spawned here, or one rank per "
                          "process under torchrun).")] = None,
    reference: Annotated[Optional[str], typer.Option(
        "--reference", help="Where the golden and intrinsic runs happen (default cpu; with --devices: devices, "
                            "each rank's own device when it has room, else cpu).")] = None,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="dtype on the device: bf16, fp16 or fp32 (default "
                                                 "bf16; with onnxruntime, the export's).")] = None,
    golden_dtype: Annotated[Optional[str], typer.Option("--golden-dtype", help="fp32, or fp64 to judge fp32 runs "
                                                        "(default fp32; fp64 for an fp32 ONNX export).")] = None,
    out: Annotated[Optional[Path], out_option("--out", "-o", help="Folder for report.json and report.md "
                                                "(default: a new run folder reports/validate/<UTC time>/ next to "
                                                "MODEL, "
                                                "where port publish finds the newest).")] = None,
    resolution: Annotated[Optional[int], typer.Option(
        "--resolution", help=f"Image side in pixels (default {FULL[0]}; {CPU[0]} when the device under test is the "
                             "cpu).")] = None,
    text_len: Annotated[Optional[int], typer.Option(
        "--text-len", help=f"Text tokens (default {FULL[1]}, as the pipelines pad to; {CPU[1]} on the cpu).")] = None,
    timesteps: Annotated[str, typer.Option("--timesteps", help="Comma-separated, in [0, 1].")] = "1.0,0.5,0.1",
    seeds: Annotated[str, typer.Option("--seeds", help="Comma-separated CPU generator seeds.")] = "0",
    base: Annotated[Optional[Path], typer.Option("--base", help="Base model folder whose text encoder(s) "
                                                 "encode --prompt as its pipeline does.")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="Prompt for real text features.")] = None,
    text_encoder: Annotated[Optional[Path], typer.Option(
        "--text-encoder", help="A 4-bit text encoder file (Nunchaku's AWQ W4A16 Qwen3 or T5), run packed, encodes "
                               "--prompt in place of --base's; the report gives its features' error.")] = None,
    max_ratio: Annotated[float, typer.Option(
        "--max-ratio", help="Largest accepted device/intrinsic error ratio.")] = 2.0,
    config: Annotated[Optional[Path], typer.Option("--config", help="Base config the weights must fit.")] = None,
    intrinsic: Annotated[Optional[str], typer.Option(
        "--intrinsic", help="native: run --dtype on the reference device; emulated: float32 arithmetic with --dtype "
                            "rounding (fast on CPUs without bf16). Default: emulated when --device is the reference "
                            "CPU (so the run measures the CPU's own kernels), else native.")] = None,
    runtime: Annotated[str, typer.Option("--runtime", help="torch (MODEL is a transformer) or onnxruntime (MODEL is "
                                         "an exported DIR/transformer).")] = "torch",
    provider: Annotated[str, typer.Option("--provider", help="onnxruntime execution provider: CPUExecutionProvider, "
                                          "CUDAExecutionProvider, CANNExecutionProvider, ...")] =
    "CPUExecutionProvider",
    ort_threads: OrtThreadsOpt = None,
    svdq_compute: Annotated[Optional[SvdqCompute], typer.Option(
        "--svdq-compute", help="A Nunchaku SVDQuant MODEL run packed on the reference and the device: w4a4 computes "
                               "what the kernel does (4-bit activations), w4a16 the dequantized weights; the golden "
                               "stays the float32 run of the dequantized weights. Default: plain linears of the "
                               "dequantized weights.")] = None,
    workspace: WorkspaceOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run the full transformer on the device against a float32 golden and judge it against bf16's own error."""
    from validation.api import validate as run_validate
    from validation.distributed import launched_by_torchrun, parse_devices
    from validation.options import check_applicable, check_options, parse_seeds, parse_timesteps

    given = {"--device": device, "--ort-threads": ort_threads, "--svdq-compute": svdq_compute, "--devices": devices}
    check_applicable(runtime, given, device=device, devices=devices, ort_threads=ort_threads)  # before any rank
    if devices is not None:
        parse_devices(devices)  # (preflight made both first; kept for a caller of this function without it)
    device = device or "cpu"
    follower = devices is not None and launched_by_torchrun() and os.environ.get("RANK", "0") != "0"
    output = _output.use(json_mode=json_, quiet=quiet or follower, heavy=True)
    recipe, model, base = _model_of(model, base, workspace, output)
    check_applicable(runtime, {**given, "--prompt": prompt or None, "--base": base, "--text-encoder": text_encoder},
                     device=device, devices=devices, ort_threads=ort_threads)
    from porting.reports import REPORTS, run_folder

    out = out or run_folder(recipe.reports if recipe is not None else model.resolve().parent / REPORTS, "validate")
    seed_list, timestep_list = parse_seeds(seeds), parse_timesteps(timesteps)
    resolution, text_len = _sizes(resolution, text_len, device, devices, runtime, output)
    check_options(resolution=resolution, text_len=text_len, timesteps=timestep_list, seeds=seed_list,
                  max_ratio=max_ratio)
    if devices is not None and not follower:  # ranks run in other processes: no per-stage progress here
        output.status(f"validating as pipeline stages over {devices} (one process per device; the report comes "
                      "when the last rank is done)")
    with _StageBar(output) as bar:
        report = run_validate(model, device=device, dtype=dtype, reference=reference, golden_dtype=golden_dtype,
                              out=out, resolution=resolution, text_len=text_len,
                              timesteps=timestep_list, seeds=seed_list, base=base, prompt=prompt,
                              max_ratio=max_ratio, config=config, intrinsic=intrinsic,
                              on_stage=bar.on_stage, runtime=runtime, provider=provider, devices=devices,
                              ort_threads=ort_threads, svdq_compute=svdq_compute.value if svdq_compute else None,
                              text_encoder=text_encoder)
    if report is not None:  # None: a torchrun rank other than 0; rank 0 writes the one report
        _report(output, report, model, out, recipe, runtime)


def preflight(*, device: Optional[str], devices: Optional[str], reference: Optional[str], runtime: str,
              ort_threads: Optional[int], svdq_compute: Optional[SvdqCompute], dtype: Optional[str],
              golden_dtype: Optional[str], intrinsic: Optional[str], resolution: Optional[int],
              text_len: Optional[int], timesteps: str, seeds: str, max_ratio: float, **_: Any) -> None:
    """validate's refusals that need no model (options that do not apply, the device strings and --devices list,
    names, sizes, seeds and timesteps), before any model library is imported or any rank started
    (`_options.checked` runs it)."""
    from validation.distributed_plan import parse_devices
    from validation.options import check_applicable, check_names, check_options, parse_seeds, parse_timesteps

    check_applicable(runtime, {"--device": device, "--ort-threads": ort_threads, "--svdq-compute": svdq_compute,
                               "--devices": devices}, device=device, devices=devices, ort_threads=ort_threads)
    if devices is not None:
        parse_devices(devices)
    check_names(runtime=runtime, devices=devices, dtype=dtype, golden_dtype=golden_dtype, intrinsic=intrinsic)
    device_option(device, "--device")
    device_option(reference, "--reference")
    resolution, text_len = _sizes(resolution, text_len, device or "cpu", devices, runtime, None)
    check_options(resolution=resolution, text_len=text_len, timesteps=parse_timesteps(timesteps),
                  seeds=parse_seeds(seeds), max_ratio=max_ratio)


def _model_of(model: Path, base: Optional[Path], workspace: Optional[Path],
              output: _output.Output) -> tuple[Any, Path, Optional[Path]]:
    """(recipe or None, the transformer to validate, --base): a recipe's transformer and base pipeline when MODEL
    names one, a pipeline folder's transformer/."""
    from ._recipe import as_recipe

    recipe = as_recipe(model, workspace)
    if recipe is not None:
        model = recipe.transformer
        if base is None and (recipe.base / "text_encoder").is_dir():
            base = recipe.base
    return recipe, transformer_of(model, output.status), base


class _StageBar:
    """The per-stage progress bar, started at the first stage (the first includes loading)."""

    def __init__(self, output: _output.Output) -> None:
        from porting.progress import clock

        self.output, self.bar, self.started = output, None, clock()

    def on_stage(self, stage: str, total: int) -> None:
        from porting.progress import StepProgress, clock

        if self.bar is None:
            self.bar = StepProgress(None if self.output.quiet else self.output.err, "validated stage", total,
                                    unit="stage", since=self.started)
            self.bar.start()
            self.bar.timed(clock() - self.started)  # the first stage includes loading; the estimate errs long
        self.bar.advance(stage)

    def __enter__(self) -> _StageBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _report(output: _output.Output, report: Any, model: Path, out: Path, recipe: Any, runtime: str) -> None:
    """Record the step in a recipe's workspace, print the report, and fail (exit 1) or hint the next step."""
    data = report.to_dict()
    if recipe is not None:
        from porting.hub.workspace import record_step
        record_step(recipe, "validate", {"report": str(out / "report.json"), "verdict": data["verdict"],
                                         "weights_sha256": data["weights_sha256"], "device": data["device"]})
    output.document(data)
    for notice in data.get("notices") or []:
        output.warning(notice)
    from validation.report import terminal_table

    output.table(terminal_table(data))
    if data["inputs"].get("prompt_features_error") is not None:
        output.note(f"the prompt was encoded by the 4-bit text encoder (packed): its features are "
                    f"{100 * data['inputs']['prompt_features_error']:.2f} % from --base's encoder (relative L2)")
    output.status(f"report: {out / 'report.json'} and {out / 'report.md'}")
    _say_chart(output, out, bool(data["blocks"]))
    if report.verdict != "pass":
        where = ("the first bad block is where to look" if data["localisation"]["per_block"] else
                 "an ONNX graph gives no per-block rows; validate the source weights with --runtime torch to "
                 "locate a bad block")
        raise CheckFailed("Validation failed: " + "; ".join(data["reasons"]) + ".",
                          hint=f"See {out / 'report.md'}; {where}.")
    if runtime == "onnxruntime" and data["export"].get("target") == "ryzenai":
        output.hint(f"lint it for the NPU flow: port export --check {Path(data['export']['folder'])} --target ryzenai")
        return
    if runtime == "onnxruntime":
        output.hint(f"run it: port generate {Path(data['export']['folder'])} --prompt TEXT")
        return
    output.hint(next_step_hint(model, out, recipe.name if recipe is not None else None))


def next_step_hint(model: Path, out: Path, recipe: str | None) -> str:
    """A next command that works when followed: publish takes a converted diffusers folder."""
    if recipe is not None:
        return f"publish it next: port publish {recipe}"
    if not model.is_dir():
        return (f"publish takes a converted folder: port convert {model} --out TRANSFORMER_DIR --strict, then "
                "port validate TRANSFORMER_DIR and port publish --transformer TRANSFORMER_DIR --base BASE_DIR "
                "--out DIR")
    return (f"publish it next: port publish --transformer {model} --report {out / 'report.json'} "
            "--base BASE_DIR --out DIR")


FULL = (512, 512)  # --resolution, --text-len: the real pipelines' sizes
CPU = (256, 128)  # on a CPU: 256 image and 128 text tokens, a quarter of the tokens, a few times faster


def _sizes(resolution: int | None, text_len: int | None, device: str, devices: str | None, runtime: str,
           output: _output.Output | None) -> tuple[int, int]:
    """--resolution and --text-len as given, else the defaults for where the model runs (said on `output` when on
    the cpu)."""
    on_cpu = runtime == "torch" and devices is None and device.split(":")[0] == "cpu"
    chosen = CPU if on_cpu else FULL
    sizes = (chosen[0] if resolution is None else resolution, chosen[1] if text_len is None else text_len)
    # 0 is a value given (and refused later), not a default
    if output is not None and on_cpu and (resolution is None or text_len is None):
        output.status(f"on cpu: --resolution {sizes[0]} --text-len {sizes[1]} by default "
                      f"({FULL[0]} and {FULL[1]} on an accelerator); pass them for more")
    return sizes


def _say_chart(output: _output.Output, out: Path, has_blocks: bool) -> None:
    """Where the per-block chart is, or why there is only its text form in report.md."""
    from porting.charts import BLOCKS_PNG, missing

    if (out / BLOCKS_PNG).is_file():
        output.status(f"chart: {out / BLOCKS_PNG} (per-block error against the budget)")
    elif has_blocks and missing():
        output.warning(f"{missing()}; report.md has the per-block chart as text")
