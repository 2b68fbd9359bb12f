"""`port compare REFERENCE CANDIDATE`: the same prompts, noise and steps through two pipelines, judged image by image.

Each side is a pipeline folder, optionally with its transformer swapped (`Side.transformer`), on its own device and
dtype. The reference side loads first with its text encoder, encodes every prompt once (the embeddings are kept on
the CPU and shared by both sides, so only the transformer and VAE paths differ), renders its images and is
released; the candidate then loads without a text encoder and renders from the same embeddings and the same float32
CPU noise. PSNR / SSIM / LPIPS are computed on the saved 8-bit PNGs (validation.image_metrics), summarised as mean,
median and 90th percentile like the SVDQuant tables, and written with a grid (reference | candidate | amplified
difference per row) into one output folder that appears only when complete.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from porting import __version__
from porting.errors import DeviceError, InputError, PortError
from porting.outputs import InputPaths, atomic_folder, check_output
from porting.pipeline import pipeload
from porting.pipeline.compare_tables import COMPARE_JSON, COMPARE_MD, fmt, summary_markdown
from porting.pipeline.generate import (
    DEFAULT_SIZE,
    DTYPES,
    check_takes_images,
    default_size,
    default_steps,
    load_references,
    parse_size,
    progress_clock,
    read_model_index,
    reference_size,
    reference_tokens,
    resolve_device,
)
from porting.reports import REPORTS, prepare_run_folder, run_folder
from porting.resources import check_compare_batch

from . import image_metrics as im

GRID_PNG = "grid.png"
GRID_TILE = 256  # longest side of one grid cell in pixels
GRID_MIN_TILE = 96  # shortest side a tiny image is enlarged to in the grid
DEFAULT_DIFF_GAIN = 8.0
CPU_DEFAULT_PROMPTS = 4  # of the built-in set, on a CPU: a run that finishes in minutes


@dataclass
class Side:
    """One side of a comparison: a pipeline folder, an optional transformer swap, where and in what it runs."""

    folder: Path
    transformer: Path | None = None
    device: str = "cpu"
    dtype: str | None = None  # default: fp32 on CPU, bf16 on accelerators
    svdq_compute: str = "w4a4"  # an SVDQuant transformer: the kernel's arithmetic (w4a4) or dequantized (w4a16)
    text_encoder: Path | None = None  # the candidate: a 4-bit text encoder file run packed, encoding its own prompts


@dataclass
class CompareResult:
    out: Path
    doc: dict[str, Any]
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures


# ---------------------------------------------------------------------------------------------------------------
# prompts and seeds

def builtin_prompts() -> list[str]:
    """The prompt set shipped with the package (porting/pipeline/prompts.txt)."""
    text = resources.files("porting.pipeline").joinpath("prompts.txt").read_text(encoding="utf-8")
    return parse_prompts(text)


def parse_prompts(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def read_prompts(path: Path) -> list[str]:
    try:
        prompts = parse_prompts(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--prompts {path}: cannot read it ({e}).") from e
    if not prompts:
        raise InputError(f"--prompts {path}: no prompts in it (one per line; # starts a comment).")
    return prompts


def seed_for(prompt: str) -> int:
    """A seed that depends on the prompt text only, stable across runs, machines and Python versions."""
    return int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:4], "big") & 0x7FFFFFFF


def assign_seeds(prompts: Sequence[str], seeds: Sequence[int] | None) -> list[int]:
    if not seeds:
        return [seed_for(p) for p in prompts]
    if len(seeds) == 1:
        return [int(seeds[0])] * len(prompts)
    if len(seeds) != len(prompts):
        raise PortError(f"--seeds: {len(seeds)} seeds for {len(prompts)} prompts; give one seed, one per prompt, "
                        "or none (a seed derived from each prompt).")
    return [int(s) for s in seeds]


# ---------------------------------------------------------------------------------------------------------------
# running one side

@dataclass
class _Prepared:
    folder: Path
    transformer: Path
    swapped: bool
    device: torch.device
    dtype_name: str
    weights: str = ""
    pipeline: str = ""
    svdq_compute: str | None = None  # set when the transformer is an SVDQuant file run packed
    export_source: Path | None = None  # an ONNX export: its transformer runs in onnxruntime, the rest from here
    text_encoder: Any = None  # an opened 4-bit text encoder (text_encoder_swap.open_swap) run packed
    embedding_error: float | None = None  # its prompt embeddings against the reference's (relative L2)

    @property
    def pipeline_folder(self) -> Path:
        """Where the pipeline's index, text encoders, VAE and scheduler are: the export's source, or the folder."""
        return self.export_source or self.folder

    def describe(self) -> dict[str, Any]:
        doc = {"folder": str(self.folder.resolve()), "transformer": str(self.transformer.resolve()),
               "transformer_swapped": self.swapped, "weights_sha256": self.weights, "pipeline": self.pipeline,
               "device": str(self.device), "dtype": self.dtype_name}
        if self.export_source is not None:
            doc.update(runtime="onnxruntime:CPUExecutionProvider", export_source=str(self.export_source.resolve()))
        if self.text_encoder is not None:
            doc.update(text_encoder=str(self.text_encoder.path.resolve()), embedding_rel_l2=self.embedding_error)
        return {**doc, "svdq_compute": self.svdq_compute} if self.svdq_compute else doc

    def load(self, svdq_compute: str, text_encoder: bool = True) -> Any:
        if self.export_source is not None:
            from porting.pipeline.ort_pipeline import load_onnx_pipeline

            pipe = load_onnx_pipeline(self.folder, DTYPES[self.dtype_name], text_encoder=text_encoder).to(self.device)
            pipe.set_progress_bar_config(disable=True)
            return pipe
        return pipeload.load(self.folder, self.device, DTYPES[self.dtype_name],
                             transformer=self.transformer if self.swapped else None, text_encoder=text_encoder,
                             svdq_compute=svdq_compute, text_encoder_file=self.text_encoder)


def _prepare(side: Side, what: str) -> _Prepared:
    from porting.pipeline.ort_pipeline import export_source, exported_weights

    folder = Path(side.folder)
    source = export_source(folder)  # an ONNX export whose components changed since it was made is refused here
    if source is not None and side.transformer is not None:
        raise PortError(f"{folder} is an ONNX export: its transformer is the exported graph; a transformer swap "
                        "applies to a pipeline folder.", hint="Drop the --*-transformer option for this side.")
    if source is not None and side.text_encoder is not None:
        raise PortError(f"{folder} is an ONNX export; --candidate-text-encoder applies to a pipeline folder.")
    read_model_index(source or folder)
    transformer = (source / "transformer" if source is not None else
                   pipeload.transformer_folder(folder, Path(side.transformer) if side.transformer else None))
    dev = resolve_device(side.device)
    dtype_name = side.dtype or ("fp32" if dev.type == "cpu" else "bf16")
    if dtype_name not in DTYPES:
        raise PortError(f"{what} dtype {dtype_name!r}: choose one of {', '.join(DTYPES)}.")
    if source is not None:  # the weights the graph was exported from, as the export recorded them
        return _Prepared(folder, transformer, False, dev, dtype_name, weights=exported_weights(folder),
                         export_source=source)
    packed = pipeload.transformer_source(transformer).svdq
    encoder = None
    if side.text_encoder is not None:
        from porting.pipeline.text_encoder_swap import open_swap

        encoder = open_swap(folder, Path(side.text_encoder))
    return _Prepared(folder, transformer, side.transformer is not None, dev, dtype_name,
                     svdq_compute=side.svdq_compute if packed else None, text_encoder=encoder)


def _call_kwargs(pipe: Any, guidance_scale: float | None, images: Sequence[Any] = ()) -> dict[str, Any]:
    accepted = inspect.signature(pipe.__call__).parameters
    kwargs: dict[str, Any] = {}
    if images:
        if "image" not in accepted:
            raise PortError(f"--image: {type(pipe).__name__} takes no reference image.")
        kwargs["image"] = list(images) if len(images) > 1 else images[0]
    if guidance_scale is not None:
        if "guidance_scale" not in accepted:
            raise PortError(f"--guidance-scale: {type(pipe).__name__} takes no guidance scale.")
        kwargs["guidance_scale"] = guidance_scale
    elif "guidance_scale" in accepted and getattr(pipe.config, "is_distilled", False):
        kwargs["guidance_scale"] = 1.0  # distilled: guidance is ignored; 1.0 spares the pipeline's warning
    return kwargs


def _needs_negative(pipe: Any, kwargs: dict[str, Any]) -> bool:
    """Whether the pipeline will run classifier-free guidance and so encode an empty negative prompt. A pipeline
    with a `true_cfg_scale` (FluxPipeline) runs it only above 1 there, its `guidance_scale` being embedded."""
    accepted = inspect.signature(pipe.__call__).parameters
    if "true_cfg_scale" in accepted:
        return "negative_prompt_embeds" in accepted and float(kwargs.get(
            "true_cfg_scale", accepted["true_cfg_scale"].default)) > 1.0
    return ("negative_prompt_embeds" in accepted and not getattr(pipe.config, "is_distilled", False)
            and float(kwargs.get("guidance_scale", accepted["guidance_scale"].default
                                 if "guidance_scale" in accepted else 1.0)) > 1.0)


Embeds = dict[str, torch.Tensor]


def _embed_names(pipe: Any) -> list[str]:
    """The prompt embeddings the pipeline takes, in the order its encode_prompt returns them: prompt_embeds, and
    pooled_prompt_embeds where there is a pooled text encoder (FluxPipeline's CLIP)."""
    accepted = inspect.signature(pipe.__call__).parameters
    return [n for n in accepted if n.endswith("prompt_embeds") and not n.startswith(("negative_", "ip_adapter"))]


def _encode(pipe: Any, prompt: str, device: torch.device) -> Embeds:
    with torch.no_grad():
        embeds = pipe.encode_prompt(prompt=prompt, device=device)
    embeds = embeds if isinstance(embeds, tuple) else (embeds,)
    return {name: t.detach().to("cpu") for name, t in zip(_embed_names(pipe), embeds)}


def _drop_text_encoders(pipe: Any) -> None:
    """Free every text encoder before denoising (text_encoder, and text_encoder_2 where there is one)."""
    for name in list(getattr(pipe, "components", {})):
        if name.startswith("text_encoder"):
            setattr(pipe, name, None)


def _render(pipe: Any, side: _Prepared, embeds: Embeds, negative: Embeds | None, seed: int,
            width: int, height: int, steps: int, kwargs: dict[str, Any],
            on_step: Callable[[float], None] | None = None) -> Any:
    dtype = DTYPES[side.dtype_name]
    call = dict(kwargs, prompt=None, **{k: v.to(side.device, dtype) for k, v in embeds.items()}, height=height,
                width=width,
                num_inference_steps=steps, latents=pipeload.initial_latents(pipe, width, height, seed),
                generator=torch.Generator("cpu").manual_seed(seed))
    if negative is not None:
        call.update({f"negative_{k}": v.to(side.device, dtype) for k, v in negative.items()})
    if on_step is not None:
        marks = {"start": progress_clock()}

        def step_end(pipeline: Any, i: int, t: Any, cb: dict[str, Any]) -> dict[str, Any]:
            now = progress_clock()
            on_step(now - marks["start"])
            marks["start"] = now
            return cb

        call["callback_on_step_end"] = step_end
    with torch.no_grad():
        return pipe(**call).images[0]


# ---------------------------------------------------------------------------------------------------------------
# writing

def _grid(pairs: Sequence[tuple[np.ndarray, np.ndarray]], gain: float) -> Any:
    from PIL import Image, ImageDraw

    h, w = pairs[0][0].shape[:2]
    # big images shrink to GRID_TILE; tiny ones grow by whole pixels so that the column labels fit
    scale = GRID_TILE / max(h, w) if max(h, w) > GRID_TILE else float(max(1, -(-GRID_MIN_TILE // min(h, w))))
    tw, th = max(1, round(w * scale)), max(1, round(h * scale))
    resample = Image.Resampling.BOX if scale < 1 else Image.Resampling.NEAREST
    header, pad = 16, 2
    grid = Image.new("RGB", (3 * tw + 4 * pad, header + len(pairs) * (th + pad) + pad), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for col, label in enumerate(("reference", "candidate", f"difference x{gain:g}")):
        draw.text((pad + col * (tw + pad) + 2, 2), label, fill=(0, 0, 0))
    for row, (ref, cand) in enumerate(pairs):
        y = header + row * (th + pad)
        cells = (ref, cand, im.amplified_difference(cand, ref, gain))
        for col, cell in enumerate(cells):
            tile = Image.fromarray(cell)
            if (tw, th) != (w, h):
                tile = tile.resize((tw, th), resample)
            grid.paste(tile, (pad + col * (tw + pad), y))
    return grid


def to_markdown(doc: dict[str, Any]) -> str:
    ref, cand, st = doc["reference"], doc["candidate"], doc["settings"]
    lines = ["# Image comparison (port compare)", "",
             f"{len(doc['images'])} prompt(s), {st['steps']} step(s), {st['width']}x{st['height']}, the same float32 "
             "CPU noise and the same text-encoder output (the reference's, computed once per prompt) on both sides.",
             "", "| | reference | candidate |", "|---|---|---|"]
    for key in ("folder", "transformer", "weights_sha256", "pipeline", "device", "dtype"):
        lines.append(f"| {key} | `{ref[key]}` | `{cand[key]}` |")
    lines += ["", *summary_markdown(doc), ""]
    gates = doc["gates"]
    set_gates = [f"{label} {gates[key]:g}" for key, label in (("min_psnr", "min PSNR"), ("max_lpips", "max LPIPS"))
                 if gates[key] is not None]
    if set_gates:
        verdict = "passed" if gates["passed"] else "FAILED: " + "; ".join(gates["failures"])
        lines += [f"Gates on the means ({', '.join(set_gates)}): {verdict}.", ""]
    lines += [f"![reference | candidate | difference]({GRID_PNG})", "", "## Per image", "",
              "| # | seed | PSNR | SSIM | LPIPS | prompt |", "|---|---|---|---|---|---|"]
    for i, row in enumerate(doc["images"]):
        psnr = f"{row['psnr']:.2f}" + (" (capped)" if row["psnr_capped"] else "")
        lines.append(f"| {i} | {row['seed']} | {psnr} | {row['ssim']:.4f} | {fmt(row['lpips'], 4)} | "
                     f"{row['prompt'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def default_out(candidate: Side) -> Path:
    """reports/compare/<UTC time>/ next to the candidate's transformer (a swap) or its folder, where publish finds
    it (the workspace layout: <recipe>/reports/)."""
    anchor = Path(candidate.transformer) if candidate.transformer else Path(candidate.folder)
    return run_folder(anchor.resolve().parent / REPORTS, "compare")


# ---------------------------------------------------------------------------------------------------------------
# the verb

def lpips_scorer(backbone: torch.nn.Module | None, weights: str | Path | None, width: int,
                 height: int) -> tuple[im.LpipsScorer | None, im.LpipsSource | None]:
    """(scorer, None), or (None, why LPIPS is unavailable: its `reason` and short `warning`). An explicit weights
    file that is missing is an error."""
    source = None if backbone is not None else im.find_backbone(weights)
    side = im.LPIPS_MIN_SIDE
    if min(width, height) < side:
        return None, im.LpipsSource(None, f"images of {width}x{height} are below LPIPS' {side} px minimum",
                                    f"LPIPS skipped: {width}x{height} images, under {side} px; pass --size {side} "
                                    "or more")
    if backbone is not None:
        return im.LpipsScorer(backbone, source="injected"), None
    if source is None or source.path is None:  # (source is None only with a backbone, handled above)
        return None, source
    return im.LpipsScorer.from_file(source.path), None


def _render_side(pipe: Any, side: _Prepared, embeds: Sequence[Embeds], negative: Embeds | None,
                 seeds: Sequence[int], size: tuple[int, int], steps: int, kwargs: dict[str, Any], folder: Path,
                 tick: Callable[[str], None], on_step: Callable[[float], None] | None = None) -> None:
    width, height = size
    for i, (embed, seed) in enumerate(zip(embeds, seeds)):
        image = _render(pipe, side, embed, negative, seed, width, height, steps, kwargs, on_step)
        image.save(folder / f"{i:03d}.png", format="PNG")
        tick(f"{folder.name} {i + 1}/{len(embeds)}")


def _gate(summary: dict[str, Any], min_psnr: float | None, max_lpips: float | None) -> list[str]:
    failures = []
    if min_psnr is not None and summary["psnr"]["mean"] < min_psnr:
        failures.append(f"mean PSNR {summary['psnr']['mean']:.2f} dB is below --min-psnr {min_psnr:g}")
    if max_lpips is not None and summary["lpips"]["mean"] > max_lpips:
        failures.append(f"mean LPIPS {summary['lpips']['mean']:.4f} is above --max-lpips {max_lpips:g}")
    return failures


def compare(reference: Side, candidate: Side, *, prompts: Sequence[str] | None = None,
            seeds: Sequence[int] | None = None, steps: int | None = None, size: str | int | None = None,
            out: str | Path | None = None, force: bool = False, lpips_weights: str | Path | None = None,
            lpips_backbone: torch.nn.Module | None = None, guidance_scale: float | None = None,
            min_psnr: float | None = None, max_lpips: float | None = None, diff_gain: float = DEFAULT_DIFF_GAIN,
            images: Sequence[str | Path] = (), on_status: Callable[[str], None] | None = None,
            on_image: Callable[[int, int, str], None] | None = None,
            inputs: InputPaths | None = None, on_step: Callable[[float], None] | None = None,
            on_render_start: Callable[[int, int], None] | None = None) -> CompareResult:
    """Render `prompts` (default: the built-in set) through both sides and write the comparison into `out`.

    `images` are reference images passed with every prompt on both sides (an editing comparison).
    `lpips_backbone` injects an AlexNet-shaped feature network (tests); otherwise `lpips_weights` or the torch hub
    cache provide it, and LPIPS is reported unavailable without them. `on_image(done, total, label)` is called after
    each rendered image, `on_step(seconds)` after each denoising step. On a CPU (either side), `size` defaults to
    CPU_DEFAULT_SIZE and the built-in set to its first CPU_DEFAULT_PROMPTS prompts, so that a run finishes in
    minutes; otherwise 1024 px and the whole set. Gates apply to the means; a missed gate is in `failures` (the
    caller decides the exit).
    `inputs` names further paths the caller read (the --prompts file): `out` keeps clear of them as of every input.
    """
    say = on_status or (lambda text: None)
    started = time.perf_counter()
    ref, cand = _prepare(reference, "--reference-dtype"), _prepare(candidate, "--dtype")
    run = _settle(ref, cand, prompts, seeds, steps, size, images, diff_gain, say)
    out = Path(out) if out is not None else default_out(candidate)
    read_paths = {"reference": reference.folder, "candidate": candidate.folder,
                  "reference transformer": reference.transformer, "candidate transformer": candidate.transformer,
                  "candidate text encoder": candidate.text_encoder,
                  "--image": list(images), "--lpips-weights": lpips_weights, **(inputs or {})}
    check_output(out, force=force, verb="compare", inputs=read_paths)  # before an hour of rendering
    # settled before anything is rendered: a gate on LPIPS must not fail after an hour of generation
    scorer, lpips_missing = lpips_scorer(lpips_backbone, lpips_weights, run.width, run.height)
    if max_lpips is not None and lpips_missing is not None:
        raise DeviceError(f"--max-lpips needs LPIPS, which is unavailable: {lpips_missing.reason}.",
                          hint="Pass --lpips-weights FILE, or drop --max-lpips.")
    im.psnr(torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 8))  # without torchmetrics: fails now, not after rendering

    say(f"hashing the transformer weights ({ref.transformer}, {cand.transformer})")
    ref.weights = ref.weights or pipeload.weights_sha256(ref.transformer)
    cand.weights = cand.weights or (ref.weights if cand.transformer.resolve() == ref.transformer.resolve() else
                                    pipeload.weights_sha256(cand.transformer))
    counter = _Counter(2 * len(run.prompts), on_image)
    timings: dict[str, float] = {}
    prepare_run_folder(out)
    with atomic_folder(out, force=force, verb="compare", inputs=read_paths) as staging:
        t0 = time.perf_counter()
        embeds, negative, kwargs = _reference_side(ref, reference.svdq_compute, run, guidance_scale, staging,
                                                   counter.tick, on_step, on_render_start, say)
        timings["reference_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        _candidate_side(cand, candidate.svdq_compute, ref.pipeline, run, guidance_scale, embeds, negative, staging,
                        counter.tick, on_step, say)
        timings["candidate_s"] = time.perf_counter() - t0

        say("scoring PSNR, SSIM" + (", LPIPS" if scorer else ""))
        t0 = time.perf_counter()
        names = [f"{i:03d}.png" for i in range(len(run.prompts))]
        scores = _score(staging, names, run.prompts, run.seeds, scorer, lpips_missing)
        timings["metrics_s"] = time.perf_counter() - t0
        pairs = [(_pixels(staging / "reference" / n), _pixels(staging / "candidate" / n)) for n in names]
        _grid(pairs, diff_gain).save(staging / GRID_PNG, format="PNG")
        failures = _gate(scores["summary"], min_psnr, max_lpips)
        timings["total_s"] = time.perf_counter() - started
        doc = _document(ref, cand, run, kwargs, images, diff_gain, scores, min_psnr, max_lpips, failures, timings)
        (staging / COMPARE_JSON).write_text(json.dumps(doc, indent=2) + "\n")
        (staging / COMPARE_MD).write_text(to_markdown(doc))
    return CompareResult(out, doc, failures)


@dataclass
class _Run:
    """What both sides render, settled before anything loads."""
    prompts: list[str]
    seeds: list[int]
    width: int
    height: int
    steps: int
    references: Any  # the --image pictures, loaded


class _Counter:
    """Images rendered so far, told to `on_image(done, total, label)`."""

    def __init__(self, total: int, on_image: Callable[[int, int, str], None] | None) -> None:
        self.done, self.total, self.on_image = 0, total, on_image

    def tick(self, label: str) -> None:
        self.done += 1
        if self.on_image:
            self.on_image(self.done, self.total, label)


def _settle(ref: Any, cand: Any, prompts: Sequence[str] | None, seeds: Sequence[int] | None, steps: int | None,
            size: str | int | None, images: Sequence[str | Path], diff_gain: float,
            say: Callable[[str], None]) -> _Run:
    """Prompts, seeds, size and steps with their defaults (smaller on a CPU, said), each side checked to take the
    images and to fit in memory, and the two transformers to take the same text embeddings."""
    on_cpu = "cpu" in (ref.device.type, cand.device.type)
    cpu_size = default_size("cpu", ref.pipeline_folder)
    if not prompts:
        builtin = builtin_prompts()
        prompts = builtin[:CPU_DEFAULT_PROMPTS] if on_cpu else builtin
        if on_cpu:
            say(f"on cpu: the first {len(prompts)} of the {len(builtin)} built-in prompts at "
                f"{cpu_size if size is None else size} px by default (--prompts FILE and --size for more)")
    prompts = list(prompts)
    seed_list = assign_seeds(prompts, seeds)
    width, height = parse_size((cpu_size if on_cpu else DEFAULT_SIZE) if size is None else size)
    if diff_gain <= 0:
        raise PortError(f"--diff-gain {diff_gain}: must be positive.")
    for side in (ref, cand):  # a text-only pipeline (FluxPipeline) refuses --image before anything loads
        check_takes_images(read_model_index(side.pipeline_folder), images)
    sizes = [reference_size(Path(p)) for p in images]
    for side, label, with_encoder in ((ref, "the reference", True), (cand, "the candidate", False)):
        pipeload.check_memory(f"comparing ({label} side on {side.device})", side.pipeline_folder, side.device,
                              side.dtype_name, width, height, transformer=side.transformer, text_encoder=with_encoder,
                              extra_tokens=reference_tokens(sizes))
    references = load_references([Path(p) for p in images])
    steps = default_steps(read_model_index(ref.pipeline_folder), ref.pipeline_folder) if steps is None else steps
    if steps < 1:
        raise PortError(f"--steps {steps}: needs at least 1.")
    dims = [pipeload.transformer_config(side.transformer).get("joint_attention_dim") for side in (ref, cand)]
    if dims[0] != dims[1]:
        raise InputError(f"the transformers take different text embeddings (joint_attention_dim {dims[0]} in "
                         f"{ref.transformer}, {dims[1]} in {cand.transformer}).",
                         hint="Both sides share the reference's text encoder: compare models of one family and size.")
    check_compare_batch(len(prompts), width, height, int(dims[0] or 0), grid_cell=GRID_TILE)
    return _Run(prompts, seed_list, width, height, steps, references)


def _reference_side(ref: Any, svdq_compute: str, run: _Run, guidance_scale: float | None, staging: Path,
                    tick: Callable[[str], None], on_step: Callable[[float], None] | None,
                    on_render_start: Callable[[int, int], None] | None,
                    say: Callable[[str], None]) -> tuple[list[Any], Any, dict[str, Any]]:
    """Load the reference with its text encoder, encode every prompt once, render its images into
    `staging/reference` and release it; the embeddings (and the negative one, under CFG) and its call kwargs."""
    say(f"loading the reference from {ref.folder} on {ref.device} ({ref.dtype_name})")
    pipe = ref.load(svdq_compute)
    ref.pipeline = type(pipe).__name__
    pipeload.check_size(pipe, run.width, run.height)
    kwargs = _call_kwargs(pipe, guidance_scale, run.references)
    say(f"encoding {len(run.prompts)} prompt(s) once with the reference's text encoder")
    embeds = [_encode(pipe, p, ref.device) for p in run.prompts]
    negative = _encode(pipe, "", ref.device) if _needs_negative(pipe, kwargs) else None
    _drop_text_encoders(pipe)  # not needed any more; frees their memory before denoising
    if on_render_start:
        on_render_start(2 * len(run.prompts), run.steps)
    (staging / "reference").mkdir()
    _render_side(pipe, ref, embeds, negative, run.seeds, (run.width, run.height), run.steps, kwargs,
                 staging / "reference", tick, on_step)
    del pipe
    pipeload.release_memory(ref.device)
    return embeds, negative, kwargs


def _candidate_side(cand: Any, svdq_compute: str, ref_pipeline: str, run: _Run, guidance_scale: float | None,
                    embeds: list[Any], negative: Any, staging: Path, tick: Callable[[str], None],
                    on_step: Callable[[float], None] | None, say: Callable[[str], None]) -> None:
    """Load the candidate without a text encoder and render the reference's embeddings into `staging/candidate`
    (with a 4-bit text encoder of its own: its own embeddings, their error against the reference's measured)."""
    own = cand.text_encoder is not None
    say(f"loading the candidate from {cand.folder} on {cand.device} ({cand.dtype_name}), "
        + ("its 4-bit text encoder packed" if own else "no text encoder"))
    pipe = cand.load(svdq_compute, text_encoder=own)
    if own:
        embeds, negative, cand.embedding_error = _own_embeddings(pipe, cand, run, embeds, negative)
        say(f"the 4-bit text encoder's prompt embeddings: {100 * cand.embedding_error:.2f} % from the reference's")
    cand.pipeline = type(pipe).__name__
    if cand.pipeline != ref_pipeline:
        say(f"note: the pipelines differ ({ref_pipeline} vs {cand.pipeline})")
    pipeload.check_size(pipe, run.width, run.height)
    ckwargs = _call_kwargs(pipe, guidance_scale, run.references)
    if _needs_negative(pipe, ckwargs) != (negative is not None):
        raise InputError(f"{cand.folder}: one side runs classifier-free guidance and the other does not; "
                         "compare two folders of the same kind.")
    (staging / "candidate").mkdir()
    _render_side(pipe, cand, embeds, negative, run.seeds, (run.width, run.height), run.steps, ckwargs,
                 staging / "candidate", tick, on_step)
    del pipe
    pipeload.release_memory(cand.device)


def _own_embeddings(pipe: Any, cand: Any, run: _Run, embeds: list[Embeds], negative: Embeds | None
                    ) -> tuple[list[Embeds], Embeds | None, float]:
    """The candidate's prompts encoded by its own (4-bit) text encoder, which is then dropped; the relative L2 of
    its prompt embeddings from the reference's, over every prompt."""
    mine = [_encode(pipe, p, cand.device) for p in run.prompts]
    mine_negative = _encode(pipe, "", cand.device) if negative is not None else None
    _drop_text_encoders(pipe)
    num = sum(float((m["prompt_embeds"].float() - e["prompt_embeds"].float()).norm() ** 2)
              for m, e in zip(mine, embeds))
    den = sum(float(e["prompt_embeds"].float().norm() ** 2) for e in embeds)
    return mine, mine_negative, (num / max(den, 1e-30)) ** 0.5


def _document(ref: Any, cand: Any, run: _Run, kwargs: dict[str, Any], images: Sequence[str | Path],
              diff_gain: float, scores: dict[str, Any], min_psnr: float | None, max_lpips: float | None,
              failures: list[str], timings: dict[str, float]) -> dict[str, Any]:
    """compare.json: both sides, the settings, the scores, the gates and the timings."""
    return {
        "tool": "flux-port", "version": __version__, "kind": "compare", "format_version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "reference": ref.describe(), "candidate": cand.describe(),
        "settings": {"steps": run.steps, "width": run.width, "height": run.height,
                     "guidance_scale": kwargs.get("guidance_scale"),
                     "noise": "float32 CPU generator per seed, cast by each pipeline",
                     "text_encoder": ("each side its own (the candidate's 4-bit, run packed)" if cand.text_encoder
                                      is not None else "reference's, once per prompt, shared by both sides"),
                     "images": [str(p) for p in images], "diff_gain": diff_gain},
        **scores,
        "grid": GRID_PNG,
        "gates": {"min_psnr": min_psnr, "max_lpips": max_lpips, "on": "mean", "passed": not failures,
                  "failures": failures},
        "timings": {k: round(v, 3) for k, v in timings.items()},
    }


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def _score(staging: Path, names: Sequence[str], prompts: Sequence[str], seeds: Sequence[int],
           scorer: im.LpipsScorer | None, lpips_missing: im.LpipsSource | None) -> dict[str, Any]:
    rows, capped = [], 0
    for name, prompt, seed in zip(names, prompts, seeds):
        a = im.to_tensor(_pixels(staging / "reference" / name))
        b = im.to_tensor(_pixels(staging / "candidate" / name))
        psnr, was_capped = im.psnr(b, a)
        capped += was_capped
        rows.append({"prompt": prompt, "seed": seed, "psnr": psnr, "psnr_capped": was_capped, "ssim": im.ssim(b, a),
                     "lpips": scorer(b, a) if scorer else None,
                     "reference": f"reference/{name}", "candidate": f"candidate/{name}"})
    summary = {"psnr": im.summarize([r["psnr"] for r in rows]), "ssim": im.summarize([r["ssim"] for r in rows]),
               "lpips": im.summarize([r["lpips"] for r in rows]) if scorer else None}
    metrics = {
        "psnr": {"library": "torchmetrics peak_signal_noise_ratio", "data_range": [0, 1], "per": "image",
                 "cap_db": im.PSNR_CAP_DB, "capped": capped},
        "ssim": {"library": "torchmetrics structural_similarity_index_measure", "data_range": [0, 1],
                 "kernel": "gaussian 11, sigma 1.5"},
        "lpips": {"library": "torchmetrics LearnedPerceptualImagePatchSimilarity", "net": "alex", "normalize": True,
                  "available": scorer is not None, "reason": lpips_missing.reason if lpips_missing else None,
                  "warning": lpips_missing.warning if lpips_missing else None,
                  "backbone": (scorer.source if scorer else None)},
    }
    return {"summary": summary, "metrics": metrics, "images": rows}
