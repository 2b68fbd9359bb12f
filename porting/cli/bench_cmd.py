"""`port bench FOLDER`: peak memory, it/s, seconds per image and load time under each offload mode."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from . import _output
from ._options import (
    DeviceOpt,
    ForceOpt,
    JsonOpt,
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

BENCH_EXAMPLES = """\b
Examples:
  port bench ./my-klein-ft --device cuda --size 1024 --steps 4
  port bench ./my-klein-ft --device npu:0 --offload none,model --task t2i --runs 5
  port bench ./FLUX.2-klein-9B --transformer ./transformer --device cuda --json
  port bench ./FLUX.2-klein-9B --transformer svdq-int4_r32-flux.2-klein-9b.safetensors --offload none,model
  port bench ./FLUX.2-klein-9B --transformer svdq-int4_r32-flux.2-klein-9b.safetensors
             --text-encoder svdq-int4-Qwen3-text-Nunchaku.safetensors --card --device cuda
  port bench ./my-klein-ft      (CPU: the no-offload row with peak RSS; offload rows need an accelerator)
"""


def bench_table(doc: dict) -> tuple[Table, list[str]]:
    """The speed / memory table for a terminal (each change against the first row in its value's cell, so that the
    model card's rows fit 80 columns as a table), and its notes."""
    from rich.table import Table

    from porting.pipeline.bench import table_cells

    header, rows, notes = table_cells(doc, compact=True)
    st = doc["settings"]
    table = Table(title=f"{doc['pipeline']} on {doc['device']} ({doc['device_name']}), {doc['dtype']}, "
                        f"{st['width']}x{st['height']}, {st['steps']} step(s), median of {st['runs']}")
    for col in header:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    return table, notes


def bench(
    folder: Annotated[Path, typer.Argument(help="Pipeline folder (published, or a base with --transformer).")],
    transformer: Annotated[Optional[Path], typer.Option(
        "--transformer", help="Run with this transformer folder (or SVDQuant file, kept packed) instead of the "
                              "folder's own.")] = None,
    svdq_compute: SvdqComputeOpt = SvdqCompute.w4a4,
    text_encoder: TextEncoderOpt = None,
    card: Annotated[bool, typer.Option("--card", help="The model card's rows: the base, each 4-bit file given "
                                       "(--transformer, --text-encoder) alone, and both, by every offload "
                                       "mode.")] = False,
    device: DeviceOpt = "cpu",
    dtype: RunDtypeOpt = None,
    offload: Annotated[str, typer.Option("--offload", help="Comma-separated modes: none, model (model CPU "
                                         "offload), sequential (sequential CPU offload), group (group "
                                         "offloading).")] = "none,model,sequential,group",
    task: Annotated[str, typer.Option("--task", help="Comma-separated: t2i (text to image), edit (with a "
                                      "reference image).")] = "t2i,edit",
    size: Annotated[Optional[str], typer.Option("--size", help="Side in pixels, or WIDTHxHEIGHT (default 1024 on an "
                                                "accelerator; on cpu 16x16 latent patches, 256 px for "
                                                "FLUX VAEs, so that a run finishes in minutes).")] = None,
    steps: StepsOpt = None,
    runs: Annotated[int, typer.Option("--runs", help="Timed runs per row (the median is reported).")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed warm-up runs per row.")] = 1,
    prompt: Annotated[Optional[str], typer.Option("--prompt", help="Text-to-image prompt.")] = None,
    image: Annotated[Optional[Path], typer.Option("--image", help="Reference image for the edit task (default: "
                                                  "a synthetic picture).")] = None,
    guidance_scale: Annotated[Optional[float], typer.Option("--guidance-scale", help="CFG scale (base and dev "
                                                            "models).")] = None,
    out: Annotated[Optional[Path], out_option("--out", "-o", help="Folder for bench.json and bench.md (default: "
                                                "reports/bench/<time>/ next to the folder, where port publish "
                                                "finds it).")] = None,
    force: ForceOpt = False,
    json_: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Measure a pipeline folder under each offload mode and task: the speed/memory table of a model card."""
    from porting.pipeline.bench import DEFAULT_PROMPT, Row, parse_list
    from porting.pipeline.bench import bench as run_bench

    output = _output.use(json_mode=json_, quiet=quiet, heavy=True)

    def on_row(row: Row) -> None:
        name = f"{row.model}: " if row.model else ""
        if row.status == "ok":
            output.status(f"{name}{row.task}/{row.mode}: {row.it_per_s} it/s, {row.s_per_image} s/image")
        elif row.status != "skipped":  # a skip's reason is said once, under the table, with the modes it skips
            output.status(f"{name}{row.task}/{row.mode}: {row.status} ({row.reason})")

    result = run_bench(folder, transformer=transformer, device=device, dtype=dtype.value if dtype else None,
                       modes=parse_list(offload, "--offload"), tasks=parse_list(task, "--task"), size=size,
                       steps=steps, runs=runs, warmup=warmup, prompt=prompt or DEFAULT_PROMPT,
                       image=image, guidance_scale=guidance_scale, out=out, force=force, on_status=output.status,
                       on_row=on_row, svdq_compute=svdq_compute.value, text_encoder=text_encoder, card=card)
    doc = result.doc
    if not output.json_mode:
        table, notes = bench_table(doc)
        output.table(table)
        for note in notes:
            output.note(note)
        output.status(f"memory counter: {doc['memory_counter']}")
    from porting.charts import BENCH_PNG, missing

    drawn = (result.out / BENCH_PNG).is_file()
    output.status(f"wrote {result.out / 'bench.json'}, bench.md" + (" and bench.png (chart)" if drawn else ""))
    if not drawn and missing():
        output.warning(f"{missing()}; bench.md has the chart as text")
    output.document({**doc, "out": str(result.out)})


def preflight(*, card: bool, transformer: Optional[Path], text_encoder: Optional[Path], offload: str, task: str,
              runs: int, warmup: int, size: Optional[str], device: str, **_: Any) -> None:
    """bench's refusals that need no model (--card without a 4-bit file, the offload modes and tasks, the run
    counts, the size, the device string), before any model library is imported (`_options.checked` runs it)."""
    from porting.errors import PortError
    from porting.pipeline.run_options import check_choices, parse_list, parse_size

    if card and transformer is None and text_encoder is None:
        raise PortError("--card compares the base with its 4-bit files: give --transformer (an SVDQuant file), "
                        "--text-encoder (a 4-bit text encoder), or both.")
    check_choices(parse_list(offload, "--offload"), parse_list(task, "--task"), runs, warmup)
    if size is not None:
        parse_size(size)
    device_option(device, "--device")
