"""`port validate MODEL --device npu:0`: is the port right on this device, and if not, where does it go wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from porting.errors import CheckFailed, PortError

from . import _output
from ._options import JsonOpt, QuietOpt, WorkspaceOpt, out_option
from ._recipe import as_recipe

VALIDATE_EXAMPLES = """\b
Examples:
  port validate ./transformer --device npu:0
  port validate Flux2-Klein-9B-True-bf16.safetensors --device cuda --resolution 1024 --seeds 0,1
  port validate ./transformer --device npu:0 --base ./FLUX.2-klein-9B --prompt "a red fox in snow"
  port validate flux2-klein-9b-true-v1 --device npu:0 --prompt "a red fox in snow"   (a recipe's workspace)
  port validate ./klein-onnx/transformer --runtime onnxruntime --provider CUDAExecutionProvider
"""


def validate(
    model: Annotated[Path, typer.Argument(help="Converted diffusers transformer folder, an original-naming file, or a "
                                          "recipe name in the workspace.")],
    device: Annotated[str, typer.Option(
        "--device", help="Device under test: cpu, cuda[:N], npu[:N], mps, xpu[:N].")] = "cpu",
    reference: Annotated[str, typer.Option("--reference", help="Where the golden and intrinsic runs happen.")] = "cpu",
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="dtype on the device: bf16, fp16 or fp32 (default "
                                                 "bf16; with onnxruntime, the export's).")] = None,
    golden_dtype: Annotated[Optional[str], typer.Option("--golden-dtype", help="fp32, or fp64 to judge fp32 runs "
                                                        "(default fp32; fp64 for an fp32 ONNX export).")] = None,
    out: Annotated[Optional[Path], out_option("--out", "-o", help="Folder for report.json and report.md "
                                                "(default: reports/ next to MODEL).")] = None,
    resolution: Annotated[int, typer.Option("--resolution", help="Image side in pixels.")] = 512,
    text_len: Annotated[int, typer.Option("--text-len", help="Text tokens (the pipeline pads to 512).")] = 512,
    timesteps: Annotated[str, typer.Option("--timesteps", help="Comma-separated, in [0, 1].")] = "1.0,0.5,0.1",
    seeds: Annotated[str, typer.Option("--seeds", help="Comma-separated CPU generator seeds.")] = "0",
    base: Annotated[Optional[Path], typer.Option("--base", help="Base model folder whose text encoder encodes "
                                                 "--prompt.")] = None,
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="Prompt for real text features.")] = None,
    max_ratio: Annotated[float, typer.Option(
        "--max-ratio", help="Largest accepted device/intrinsic error ratio.")] = 2.0,
    config: Annotated[Optional[Path], typer.Option("--config", help="Base config the weights must fit.")] = None,
    intrinsic: Annotated[str, typer.Option(
        "--intrinsic", help="native: run --dtype on the reference device; emulated: "
                            "float32 arithmetic with --dtype rounding (fast on CPUs without bf16).")] = "native",
    runtime: Annotated[str, typer.Option("--runtime", help="torch (MODEL is a transformer) or onnxruntime (MODEL is "
                                         "an exported DIR/transformer).")] = "torch",
    provider: Annotated[str, typer.Option("--provider", help="onnxruntime execution provider: CPUExecutionProvider, "
                                          "CUDAExecutionProvider, CANNExecutionProvider, ...")] =
    "CPUExecutionProvider",
    workspace: WorkspaceOpt = None,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run the full transformer on the device against a float32 golden and judge it against bf16's own error."""
    from validation.api import validate as run_validate
    from validation.options import check_options, parse_seeds, parse_timesteps
    from validation.report import terminal_table

    output = _output.use(json_mode=json_, quiet=quiet, heavy=True)
    recipe = as_recipe(model, workspace)
    if recipe is not None:
        model, out = recipe.transformer, out or recipe.reports
        if base is None and (recipe.base / "text_encoder").is_dir():
            base = recipe.base
    if prompt and base is None:
        raise PortError("--prompt needs --base (the base model's text encoder encodes it).")
    out = out or (model.resolve().parent / "reports")
    seed_list, timestep_list = parse_seeds(seeds), parse_timesteps(timesteps)
    check_options(resolution=resolution, text_len=text_len, timesteps=timestep_list, seeds=seed_list,
                  max_ratio=max_ratio)
    progress = None
    if not output.quiet:
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=output.err, transient=True)
    task = None

    def on_stage(stage: str, total: int) -> None:
        nonlocal task
        if progress is None:
            return
        if task is None:
            task = progress.add_task("validating", total=total)
        progress.update(task, advance=1, description=f"validated {stage}")

    if progress:
        progress.start()
    try:
        report = run_validate(model, device=device, dtype=dtype, reference=reference, golden_dtype=golden_dtype,
                              out=out, resolution=resolution, text_len=text_len,
                              timesteps=timestep_list, seeds=seed_list, base=base, prompt=prompt,
                              max_ratio=max_ratio, config=config, intrinsic=intrinsic,
                              on_stage=on_stage, runtime=runtime, provider=provider)
    finally:
        if progress:
            progress.stop()
    data = report.to_dict()
    if recipe is not None:
        from porting.hub.workspace import record_step
        record_step(recipe, "validate", {"report": str(out / "report.json"), "verdict": data["verdict"],
                                         "weights_sha256": data["weights_sha256"], "device": data["device"]})
    output.document(data)
    output.table(terminal_table(data))
    output.status(f"report: {out / 'report.json'} and {out / 'report.md'}")
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
