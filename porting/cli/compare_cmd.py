"""`port compare REFERENCE CANDIDATE`: PSNR / SSIM / LPIPS of two pipelines on the same prompts, noise and steps."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from porting.errors import CheckFailed, PortError

from . import _output
from ._options import (
    ForceOpt,
    JsonOpt,
    QuietOpt,
    RunDtype,
    StepsOpt,
    SvdqCompute,
    SvdqComputeOpt,
    device_option,
    out_option,
)

if TYPE_CHECKING:
    from porting.progress import StepProgress

COMPARE_EXAMPLES = """\b
Examples:
  port compare ./FLUX.2-klein-4B ./my-klein-ft --device cuda --steps 4      (base vs published port)
  port compare ./published ./published --reference-device cpu --device npu:0 --max-lpips 0.05   (CPU vs NPU)
  port compare ./base ./base --reference-transformer ./bf16 --candidate-transformer ./fp8-dequant --device cuda
  port compare ./base ./base --candidate-transformer svdq-int4_r32-flux.2-klein-9b.safetensors   (packed, w4a4)
  port compare ./base ./ft --prompt "a red fox in the snow" --prompt "a neon street" --seeds 0 --out cmp/ --json
"""



def _seeds(text: str | None) -> list[int] | None:
    from porting.seeds import parse_seeds

    return parse_seeds(text, "--seeds") if text else None


def compare(
    reference: Annotated[Path, typer.Argument(help="Reference pipeline folder (the original, e.g. the bf16 base or "
                                              "a CPU run).")],
    candidate: Annotated[Path, typer.Argument(help="Candidate pipeline folder (the port); may be the same folder "
                                              "as REFERENCE with another transformer or device.")],
    reference_transformer: Annotated[Optional[Path], typer.Option(
        "--reference-transformer", help="Run the reference with this transformer folder (or SVDQuant file) instead of "
                                        "its own.")] = None,
    candidate_transformer: Annotated[Optional[Path], typer.Option(
        "--candidate-transformer", help="Run the candidate with this transformer folder (or SVDQuant file) instead "
                                        "of its own.")] = None,
    candidate_text_encoder: Annotated[Optional[Path], typer.Option(
        "--candidate-text-encoder", help="Run the candidate with this 4-bit text encoder file (Nunchaku's AWQ "
                                         "W4A16 Qwen3 or T5), packed, encoding its own prompts; their embeddings' "
                                         "error against the reference's is reported.")] = None,
    svdq_compute: SvdqComputeOpt = SvdqCompute.w4a4,
    reference_device: Annotated[str, typer.Option("--reference-device", help="Where the reference runs.")] = "cpu",
    device: Annotated[str, typer.Option("--device", help="Where the candidate runs: cpu, cuda[:N], npu[:N].")] = "cpu",
    reference_dtype: Annotated[Optional[RunDtype], typer.Option(
        "--reference-dtype", help="bf16, fp16 or fp32 (default fp32 on cpu, bf16 on accelerators).")] = None,
    dtype: Annotated[Optional[RunDtype], typer.Option("--dtype", help="The candidate's dtype (same default).")] = None,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt (repeatable).")] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Text file, one prompt per line "
                                                    "(# comments). Default: the built-in set of 37 (its first 4 when "
                                                    "either side runs on cpu, so that the run finishes in "
                                                    "minutes).")] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="One seed for all prompts or one per prompt, "
                                                 "comma-separated (default: derived from each prompt).")] = None,
    steps: StepsOpt = None,
    size: Annotated[Optional[str], typer.Option("--size", help="Side in pixels, or WIDTHxHEIGHT (default 1024; when "
                                                "either side runs on cpu, 16x16 latent patches: 256 px for "
                                                "FLUX VAEs).")] = None,
    guidance_scale: Annotated[Optional[float], typer.Option("--guidance-scale", help="CFG scale for both sides "
                                                            "(base and dev models).")] = None,
    image: Annotated[Optional[list[Path]], typer.Option("--image", help="Reference image passed with every prompt "
                                                        "on both sides: an editing comparison "
                                                        "(repeatable).")] = None,
    out: Annotated[Optional[Path], out_option("--out", "-o", help="Output folder (default: reports/compare/<time>"
                                                "/ next to the candidate, where port publish finds it).")] = None,
    lpips_weights: Annotated[Optional[Path], typer.Option(
        "--lpips-weights", help="AlexNet backbone for LPIPS (torchvision's alexnet-owt-7be5be79.pth); default: the "
                                "torch hub cache. Never downloaded.")] = None,
    min_psnr: Annotated[Optional[float], typer.Option("--min-psnr", help="Exit 1 when the mean PSNR (dB) is "
                                                      "below this.")] = None,
    max_lpips: Annotated[Optional[float], typer.Option("--max-lpips", help="Exit 1 when the mean LPIPS is above "
                                                       "this.")] = None,
    diff_gain: Annotated[float, typer.Option("--diff-gain", help="Amplification of |difference| in the "
                                             "grid.")] = 8.0,
    force: ForceOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Render the same prompts through two pipelines and report PSNR / SSIM / LPIPS (mean, p50, p90), with a grid."""
    from validation.image_compare import Side, read_prompts
    from validation.image_compare import compare as run_compare

    output = _output.use(json_mode=json_, quiet=quiet, heavy=True)
    prompt_list = list(prompt) if prompt else (read_prompts(prompts) if prompts else None)
    with _RenderBar(output) as bar:
        result = run_compare(
            Side(reference, reference_transformer, reference_device,
                 reference_dtype.value if reference_dtype else None, svdq_compute.value),
            Side(candidate, candidate_transformer, device, dtype.value if dtype else None, svdq_compute.value,
                 candidate_text_encoder),
            prompts=prompt_list, seeds=_seeds(seeds), steps=steps, size=size, out=out, force=force,
            lpips_weights=lpips_weights, guidance_scale=guidance_scale, min_psnr=min_psnr, max_lpips=max_lpips,
            diff_gain=diff_gain, images=image or [], on_status=bar.say, on_image=bar.on_image,
            inputs={"--prompts": prompts}, on_step=bar.on_step, on_render_start=bar.on_render_start)
    _report(output, result)


def preflight(*, prompt: Optional[list[str]], prompts: Optional[Path], seeds: Optional[str], size: Optional[str],
              device: str, reference_device: str, diff_gain: float, **_: Any) -> None:
    """compare's refusals that need no model (--prompt with --prompts, the seeds, the size, the device strings,
    --diff-gain), before any model library is imported (`_options.checked` runs it)."""
    from porting.pipeline.run_options import parse_size

    if prompt and prompts:
        raise PortError("give --prompt or --prompts, not both.")
    if diff_gain <= 0:
        raise PortError(f"--diff-gain {diff_gain}: must be positive.")
    _seeds(seeds)
    if size is not None:
        parse_size(size)
    device_option(reference_device, "--reference-device")
    device_option(device, "--device")


class _RenderBar:
    """The rendering progress bar (one unit a denoising step), started when rendering starts; status lines go above
    it."""

    def __init__(self, output: _output.Output) -> None:
        self.output = output
        self.bar: StepProgress | None = None

    def on_render_start(self, images: int, steps_per_image: int) -> None:
        from porting.progress import StepProgress

        self.bar = StepProgress(None if self.output.quiet else self.output.err, "rendered", images,
                                unit="denoising step", estimate_units=images * steps_per_image)
        self.bar.start()

    def on_image(self, done: int, total: int, label: str) -> None:
        if self.bar is not None:
            self.bar.advance(label)

    def on_step(self, seconds: float) -> None:
        if self.bar is not None:
            self.bar.timed(seconds)

    def say(self, text: str) -> None:  # status lines above the live bar
        if self.bar is None:
            self.output.status(text)
        elif not self.output.quiet:
            self.bar.say(text)

    def __enter__(self) -> _RenderBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def _report(output: _output.Output, result: Any) -> None:
    """The summary table, the notes on PSNR and LPIPS, and the gate: exit 1 (with the document under --json) when
    it was missed."""
    from rich.table import Table

    from porting.pipeline.compare_tables import summary_rows

    doc = result.doc
    if not output.json_mode:
        table = Table(title=f"{len(doc['images'])} image(s): candidate against reference")
        for col in ("metric", "mean", "p50", "p90"):
            table.add_column(col)
        for name, stats, digits in summary_rows(doc):
            table.add_row(name, *([f"{stats[k]:.{digits}f}" for k in ("mean", "p50", "p90")] if stats
                                  else ["unavailable", "", ""]))
        output.table(table)
    metrics = doc["metrics"]
    if doc["candidate"].get("embedding_rel_l2") is not None:
        error = 100 * doc["candidate"]["embedding_rel_l2"]
        output.note(f"the candidate's 4-bit text encoder: prompt embeddings {error:.2f} % from the reference's "
                    "(relative L2); each side rendered its own")
    if metrics["psnr"]["capped"]:
        output.status(f"PSNR capped at {metrics['psnr']['cap_db']:g} dB for {metrics['psnr']['capped']} identical "
                      "image pair(s).")
    if not metrics["lpips"]["available"]:
        output.warning(metrics["lpips"]["warning"])
    output.status(f"wrote {result.out} (compare.json, compare.md, grid.png, reference/, candidate/)")
    if not result.passed:
        message = "compare gate missed: " + "; ".join(result.failures) + "."
        if output.json_mode:  # one document: the comparison, saying why it failed
            output.document({**doc, "out": str(result.out), "error": message, "exit_code": CheckFailed.exit_code})
            output.error(f"Error: {message}")
            raise typer.Exit(CheckFailed.exit_code)
        raise CheckFailed(message, hint=f"See {result.out / 'grid.png'} for where the images differ.")
    output.document({**doc, "out": str(result.out)})
