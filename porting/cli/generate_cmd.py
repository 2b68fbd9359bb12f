"""`port generate FOLDER --prompt TEXT`: run a published folder and report its speed and memory."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from . import _output
from ._options import (
    DeviceOpt,
    JsonOpt,
    OrtThreadsOpt,
    QuietOpt,
    RunDtypeOpt,
    StepsOpt,
    SvdqCompute,
    SvdqComputeOpt,
    TextEncoderOpt,
    device_option,
    out_option,
)

if TYPE_CHECKING:
    from rich.table import Table

    from porting.pipeline.generate import GenerateResult

GENERATE_EXAMPLES = """\b
Examples:
  port generate ./my-klein-ft --prompt "a red fox in the snow" --device npu:0 --steps 4 --output fox.png
  port generate ./my-klein-ft --prompt "a red fox" --device cuda --size 768x1024 --cpu-offload model
  port generate ./my-klein-ft --prompt "make it winter" --image ref.png --device cuda --output edit.png
  port generate ./my-klein-ft-onnx --prompt "a red fox" --provider CPUExecutionProvider   (port export's folder)
  port generate ./FLUX.2-klein-9B --transformer svdq-int4_r32-flux.2-klein-9b.safetensors --prompt "a red fox"
  port generate ./FLUX.2-klein-9B --text-encoder svdq-int4-Qwen3-text-Nunchaku.safetensors --prompt "a red fox"
"""


class OffloadChoice(str, Enum):
    model = "model"
    sequential = "sequential"



def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def summary_table(r: GenerateResult) -> Table:
    from rich.table import Table

    table = Table(title="generated", show_header=False)
    table.add_row("image", f"{r.output} ({r.width}x{r.height})")
    table.add_row("pipeline", f"{r.pipeline} on {r.device} ({r.dtype}" + (f", {r.cpu_offload} offload)"
                                                                           if r.cpu_offload else ")"))
    if r.transformer_runtime != "torch":
        table.add_row("transformer", f"{r.transformer_runtime} (ONNX export; the rest in torch)")
    table.add_row("load", f"{r.load_s:.2f} s")
    table.add_row("denoising", f"{r.denoise_s:.2f} s for {r.steps} step(s), {r.s_per_it:.3f} s/it")
    table.add_row("total call", f"{r.total_s:.2f} s (text encoding, denoising, decoding)")
    table.add_row("peak memory", f"{_gb(r.peak_memory_bytes)} ({r.peak_memory_kind})")
    if r.text_encoder:
        te = r.text_encoder
        table.add_row("text encoder", f"4-bit, packed ({te['file']}): prompt embeddings "
                                      f"{100 * te['embedding_rel_l2']:.2f} % from the folder's own (relative L2)")
    return table


def generate(
    folder: Annotated[Path, typer.Argument(help="Published pipeline folder (port publish --out).")],
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text prompt.")],
    device: DeviceOpt = "cpu",
    steps: StepsOpt = None,
    seed: Annotated[int, typer.Option("--seed", help="Noise seed (CPU generator: same image on every "
                                                     "device).")] = 0,
    size: Annotated[Optional[str], typer.Option("--size", help="Side in pixels, or WIDTHxHEIGHT (default 1024 on an "
                                                "accelerator; on cpu 16x16 latent patches, 256 px for "
                                                "FLUX VAEs, so that a run finishes in minutes).")] = None,
    output: Annotated[Path, out_option("--output", "-o", help="PNG file to write.")] = Path("image.png"),
    cpu_offload: Annotated[Optional[OffloadChoice], typer.Option("--cpu-offload", help="Keep weights on CPU and "
                                                                 "move them to the device per model or per "
                                                                 "layer.")] = None,
    image: Annotated[Optional[list[Path]], typer.Option("--image", help="Reference image for editing "
                                                        "(repeatable).")] = None,
    dtype: RunDtypeOpt = None,
    guidance_scale: Annotated[Optional[float], typer.Option("--guidance-scale", help="CFG scale (base and dev "
                                                            "models; distilled models ignore it).")] = None,
    transformer: Annotated[Optional[Path], typer.Option(
        "--transformer", help="Run with this transformer folder (or SVDQuant file, kept packed) instead of the "
                              "folder's own.")] = None,
    svdq_compute: SvdqComputeOpt = SvdqCompute.w4a4,
    text_encoder: TextEncoderOpt = None,
    provider: Annotated[str, typer.Option("--provider", help="onnxruntime execution provider, for an ONNX export "
                                          "folder (port export).")] = "CPUExecutionProvider",
    ort_threads: OrtThreadsOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --output if it exists (only an image flux-port "
                                        "wrote).")] = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Generate an image from a published folder; prints load time, denoising time, s/it and peak memory.

    On a CPU the defaults fit the machine: float32 compute and 16x16 latent patches (256 px for FLUX VAEs; both
    overridable), and a run whose first step says it would pass a minute prints its estimate first."""
    out = _output.use(json_mode=json_, quiet=quiet, heavy=True)
    from porting import progress
    from porting.pipeline.generate import generate as run_generate
    from porting.progress import StepProgress
    from porting.seeds import check_seed

    check_seed(seed, "--seed")
    bar: StepProgress | None = None

    def on_step(done: int, total: int, seconds: float) -> None:
        nonlocal bar
        if bar is None:
            # made when the first step has finished: its time counts as elapsed (the first line said 0.0 s)
            bar = StepProgress(None if out.quiet else out.err, "denoising step", total,
                               since=progress.clock() - seconds)
            bar.start()
            bar.timed(seconds)
        bar.advance(f"{seconds:.2f} s")

    try:
        result = run_generate(folder, prompt, device=device, steps=steps, seed=seed, size=size, output=output,
                              cpu_offload=cpu_offload.value if cpu_offload else None, images=image or [],
                              dtype=dtype.value if dtype else None, guidance_scale=guidance_scale,
                              progress=not out.quiet, on_status=out.status, provider=provider, force=force,
                              ort_threads=ort_threads, on_step=on_step, transformer=transformer,
                              svdq_compute=svdq_compute.value, text_encoder=text_encoder)
    finally:
        if bar is not None:
            bar.stop()
    out.document(result.to_dict())
    out.table(summary_table(result))


def preflight(*, seed: int, size: Optional[str], device: str, output: Path, cpu_offload: Optional[OffloadChoice],
              **_: Any) -> None:
    """generate's refusals that need no model (the seed, the size, the device string, --cpu-offload on the cpu,
    an --output that is not a PNG), before any model library is imported (`_options.checked` runs it)."""
    from porting.devices import parse_device
    from porting.errors import PortError
    from porting.pipeline.run_options import parse_size
    from porting.seeds import check_seed

    check_seed(seed, "--seed")
    if size is not None:
        parse_size(size)
    device_option(device, "--device")
    if cpu_offload is not None and parse_device(device).type == "cpu":
        raise PortError("--cpu-offload moves weights between CPU and an accelerator; it needs --device cuda or "
                        "npu:N.")
    if output.suffix.lower() != ".png":
        raise PortError(f"--output {output}: flux-port writes PNG; name the file *.png.")
