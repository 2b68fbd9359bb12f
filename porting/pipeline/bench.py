"""`port bench FOLDER`: speed and memory of a pipeline folder under each offload mode, as model cards table them.

For every offload mode (none, diffusers' model CPU offload, sequential CPU offload, group offloading) the pipeline is
loaded afresh (load time), then each task (text-to-image; edit, which passes a reference image) runs `warmup`
untimed and `runs` timed calls from the same CPU-generator seed. A row records the median seconds per image, it/s
over the denoising loop (first transformer call to last step, synchronised), and the peak memory with the counter
named: on CUDA / NPU the allocator's `max_memory_reserved` and `max_memory_allocated`, reset before each row; on CPU
the process peak RSS (VmHWM, reset per row where Linux allows). Offloading moves weights between CPU memory and an
accelerator, so on CPU those rows are reported as skipped, never measured. Rows compare to the first mode's row of
the same task (relative change), like the SVDQuant table.
"""

from __future__ import annotations

import inspect
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from porting import __version__, charts
from porting.errors import PortError
from porting.finite import dumps
from porting.outputs import atomic_folder, check_output
from porting.progress import duration, estimate_line
from porting.reports import REPORTS, prepare_run_folder, run_folder

from . import pipeload
from .generate import (
    DTYPES,
    MIN_REFERENCE_SIDE,
    REFERENCE_AREA,
    default_size,
    default_steps,
    load_references,
    parse_size,
    progress_clock,
    read_model_index,
    resolve_device,
)
from .run_options import TASKS, check_choices, parse_list  # noqa: F401  (bench.parse_list, bench.TASKS: the CLI's)

BENCH_JSON = "bench.json"
BENCH_MD = "bench.md"
DEFAULT_PROMPT = "a red fox standing in fresh snow at dawn, soft golden light"
EDIT_PROMPT = "turn the scene into a snowy winter evening"
CPU_OFFLOAD_REASON = ("offloading moves weights between CPU memory and an accelerator; on the CPU there is nothing "
                      "to offload to (run with --device cuda or npu:N)")


@dataclass
class Row:
    mode: str
    task: str
    status: str  # ok, skipped, oom, failed
    reason: str | None = None
    load_s: float | None = None
    s_per_image: float | None = None
    denoise_s: float | None = None
    it_per_s: float | None = None
    runs_s: list[float] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)
    vs_first: dict[str, float | None] = field(default_factory=dict)
    model: str = ""  # with --card: which of the model card's rows (base, 4-bit text encoder, ...)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BenchResult:
    out: Path
    doc: dict[str, Any]


# ---------------------------------------------------------------------------------------------------------------
# memory counters

class _Memory:
    """Peak memory of one row: the accelerator allocator's, or the process peak RSS on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.acc = getattr(torch, device.type, None) if device.type != "cpu" else None

    @property
    def counter(self) -> str:
        if self.acc is not None:
            return f"torch.{self.device.type}.max_memory_reserved (allocated: max_memory_allocated)"
        return "process peak RSS (VmHWM, reset per row)" if self._can_reset() else \
            "process peak RSS since start (ru_maxrss)"

    @staticmethod
    def _can_reset() -> bool:
        return Path("/proc/self/clear_refs").exists() and Path("/proc/self/status").exists()

    def reset(self) -> None:
        if self.acc is not None:
            self.acc.synchronize(self.device)
            self.acc.reset_peak_memory_stats(self.device)
        elif self._can_reset():
            try:
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
            except OSError:
                pass

    def sync(self) -> None:
        if self.acc is not None:
            self.acc.synchronize(self.device)

    def read(self) -> dict[str, Any]:
        if self.acc is not None:
            self.sync()
            return {"counter": self.counter, "peak_bytes": int(self.acc.max_memory_reserved(self.device)),
                    "reserved_bytes": int(self.acc.max_memory_reserved(self.device)),
                    "allocated_bytes": int(self.acc.max_memory_allocated(self.device))}
        peak = None
        if self._can_reset():
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
        if peak is None:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak = rss if sys.platform == "darwin" else rss * 1024
        return {"counter": self.counter, "peak_bytes": peak, "reserved_bytes": None, "allocated_bytes": None}


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(e).lower()


# ---------------------------------------------------------------------------------------------------------------
# one row

def edit_image(width: int, height: int) -> Any:
    """A deterministic reference picture for the edit task: smooth colour ramps with a few shapes."""
    import numpy as np
    from PIL import Image, ImageDraw

    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rgb = np.stack([x / max(1, width - 1), y / max(1, height - 1), 0.5 + 0.5 * np.sin((x + y) / 23.0)], axis=-1)
    img = Image.fromarray((rgb * 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    draw.ellipse((width * 0.2, height * 0.2, width * 0.55, height * 0.55), fill=(240, 240, 240))
    draw.rectangle((width * 0.6, height * 0.5, width * 0.9, height * 0.85), fill=(30, 60, 140))
    return img


def _run_task(pipe: Any, task: str, memory: _Memory, *, prompt: str, image: Any, width: int, height: int,
              steps: int, runs: int, warmup: int, kwargs: dict[str, Any],
              on_run: Callable[[str], None],
              on_step: Callable[[float], None] | None = None) -> tuple[list[float], list[float], dict[str, Any]]:
    marks: dict[str, float] = {}

    def first_forward(module: Any, args: Any) -> None:
        marks.setdefault("start", time.perf_counter())
        marks.setdefault("step", progress_clock())

    def step_end(pipeline: Any, i: int, t: Any, cb: dict[str, Any]) -> dict[str, Any]:
        memory.sync()
        marks["end"] = time.perf_counter()
        now = progress_clock()
        if on_step is not None:
            on_step(now - marks.get("step", now))
        marks["step"] = now
        return cb

    call = dict(kwargs, prompt=prompt, height=height, width=width, num_inference_steps=steps,
                callback_on_step_end=step_end)
    if task == "edit":
        call["image"] = image
    totals, denoise = [], []
    memory.reset()
    handle = pipe.transformer.register_forward_pre_hook(first_forward)
    try:
        for i in range(warmup + runs):
            marks.clear()
            started = time.perf_counter()
            with torch.no_grad():
                pipe(**call, generator=torch.Generator("cpu").manual_seed(0))
            memory.sync()
            if i >= warmup:
                totals.append(time.perf_counter() - started)
                denoise.append(marks.get("end", started) - marks.get("start", started))
            on_run(f"{'warm-up' if i < warmup else 'run'} {i + 1 - (warmup if i >= warmup else 0)}")
    finally:
        handle.remove()
    return totals, denoise, memory.read()


def _relative(rows: list[Row]) -> dict[str, str | None]:
    """Fill `vs_first` of every row against the first measured row of its task; returns the baseline modes."""
    baselines: dict[str, str | None] = {}
    for task in dict.fromkeys(r.task for r in rows):
        same = [r for r in rows if r.task == task]  # with --card: the base's first row is the baseline
        base = next((r for r in same if r.status == "ok"), None)
        baselines[task] = base.mode if base else None
        for r in same:
            if base is None or r.status != "ok":
                continue
            peak, base_peak = r.memory.get("peak_bytes"), base.memory.get("peak_bytes")
            r.vs_first = {
                "peak_memory": peak / base_peak - 1 if peak and base_peak else None,
                "it_per_s": r.it_per_s / base.it_per_s - 1 if r.it_per_s and base.it_per_s else None,
            }
    return baselines


# ---------------------------------------------------------------------------------------------------------------
# writing

def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:+.1f}%"


def table_cells(doc: dict[str, Any], compact: bool = False) -> tuple[list[str], list[list[str]], list[str]]:
    """(header, one row of cells per task and offload mode, notes): the speed/memory table. `compact` (a terminal's
    80 columns): each change against the first row in brackets in its value's cell, not a column of its own."""
    accelerator = doc["device"] != "cpu"
    models = any(r.get("model") for r in doc["rows"])
    peak_name = "peak reserved (allocated)" if accelerator else "peak RSS"
    header = ["model"] * models + ["task", "offload", *([f"{peak_name} (vs first)", "it/s (vs first)"] if compact
                                                        else [peak_name, "vs first", "it/s", "vs first"]),
                                   "s/image", "load s"]
    rows = []
    for r in doc["rows"]:
        load = "" if r["load_s"] is None else f"{r['load_s']:.1f}"
        lead = [r.get("model", "")] * models
        if r["status"] != "ok":
            rows.append([*lead, r["task"], r["mode"], r["status"].upper(), *[""] * (2 if compact else 4), load])
            continue
        m, vs = r["memory"], r["vs_first"]
        peak = _gib(m["peak_bytes"]) + (f" ({_gib(m['allocated_bytes'])})" if m.get("allocated_bytes") else "")
        speed = f"{r['it_per_s']:.3g}"
        if compact:
            changes = [f"{peak} ({_pct(vs.get('peak_memory'))})" if vs.get("peak_memory") is not None else peak,
                       f"{speed} ({_pct(vs.get('it_per_s'))})" if vs.get("it_per_s") is not None else speed]
        else:
            changes = [peak, _pct(vs.get("peak_memory")), speed, _pct(vs.get("it_per_s"))]
        rows.append([*lead, r["task"], r["mode"], *changes, f"{r['s_per_image']:.3g}", load])
    by_reason: dict[str, list[str]] = {}
    for r in doc["rows"]:
        if r["status"] != "ok" and r["reason"]:
            modes = by_reason.setdefault(r["reason"], [])
            if r["mode"] not in modes:
                modes.append(r["mode"])
    notes = [f"{', '.join(modes)}: {reason}." for reason, modes in by_reason.items()]
    return header, rows, notes


def table_markdown(doc: dict[str, Any]) -> list[str]:
    header, rows, notes = table_cells(doc)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + ([""] + [f"- {n}" for n in notes] if notes else [])


def to_markdown(doc: dict[str, Any], chart: str | None = "") -> str:
    """bench.md; `chart`: the PNG next to it, None for the text chart (no matplotlib), "" for none."""
    st = doc["settings"]
    lines = ["# Speed and memory (port bench)", "",
             f"`{doc['pipeline']}` from `{doc['folder']}` (transformer `{doc['transformer']}`, weights "
             f"`{doc['weights_sha256'][:16]}...`) on `{doc['device']}` ({doc['device_name']}) in {doc['dtype']}, "
             f"{st['width']}x{st['height']}, {st['steps']} step(s), median of {st['runs']} run(s) after "
             f"{st['warmup']} warm-up. Memory counter: {doc['memory_counter']}.", "", *table_markdown(doc), ""]
    if chart != "":
        lines += charts.markdown(chart, "peak memory and seconds per image per offload mode",
                                 charts.bench_text_chart(doc))
    return "\n".join(lines)


def default_out(folder: Path, transformer: Path | None) -> Path:
    anchor = transformer if transformer is not None else folder
    return run_folder(anchor.resolve().parent / REPORTS, "bench")


def _device_name(device: torch.device) -> str:
    acc = getattr(torch, device.type, None) if device.type != "cpu" else None
    if acc is not None and hasattr(acc, "get_device_name"):
        try:
            return str(acc.get_device_name(device))
        except Exception:  # a backend without names
            pass
    import platform
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------------------------------------------
# the verb

@dataclass
class _Settings:
    """What every timed run of one bench shares."""

    folder: Path
    swap: Path | None
    dev: torch.device
    dtype_name: str
    width: int
    height: int
    steps: int
    runs: int
    warmup: int
    prompt: str
    edit_prompt: str
    reference: Any
    guidance_scale: float | None
    svdq_compute: str
    text_encoder: Any = None  # an opened 4-bit text encoder (text_encoder_swap.open_swap), run packed
    label: str = ""  # the model card row these settings stand for (--card)


# Nunchaku's model cards tabulate the base against its 4-bit parts: (row, 4-bit transformer?, 4-bit text encoder?)
CARD_ROWS = (("base", False, False), ("4-bit text encoder", False, True), ("4-bit transformer", True, False),
             ("4-bit transformer + text encoder", True, True))


def card_settings(s: _Settings, card: bool) -> list[_Settings]:
    """The settings of each row to run: one (as given), or with `card` the model card's rows that the given
    4-bit files make (the base without them, each alone, both)."""
    if not card:
        return [s]
    rows = [(label, tr, te) for label, tr, te in CARD_ROWS
            if (not tr or s.swap is not None) and (not te or s.text_encoder is not None)]
    return [replace(s, swap=s.swap if tr else None, text_encoder=s.text_encoder if te else None, label=label)
            for label, tr, te in rows]


class RunProgress:
    """Each finished run (warm-up or timed) said with the count, the time since the first run began and the rest at
    the pace so far: `t2i/none run 2 done (5/16 runs; 12 s elapsed, about 26 s left)`."""

    def __init__(self, say: Callable[[str], None], total: int) -> None:
        self.say, self.total, self.done = say, total, 0
        self.since = progress_clock()

    def __call__(self, what: str) -> None:
        self.done += 1
        elapsed = progress_clock() - self.since
        left = (f", about {duration(elapsed / self.done * (self.total - self.done))} left"
                if self.done < self.total else "")
        self.say(f"  {what} done ({self.done}/{self.total} runs; {duration(elapsed)} elapsed{left})")


def _call_kwargs(pipe: Any, accepted: Any, guidance_scale: float | None) -> dict[str, Any]:
    """guidance_scale as given, else 1.0 for a distilled pipeline that takes one."""
    kwargs: dict[str, Any] = {}
    if guidance_scale is not None:
        kwargs["guidance_scale"] = guidance_scale
    elif "guidance_scale" in accepted and getattr(pipe.config, "is_distilled", False):
        kwargs["guidance_scale"] = 1.0
    return kwargs


def _bench_mode(mode: str, tasks: list[str], s: _Settings, memory: _Memory, pipeline_name: str,
                say: Callable[[str], None], emit: Callable[[Row], None], on_step: Callable[[float], None],
                ran: Callable[[str], None]) -> str:
    """Load the pipeline under one offload mode and time each task; returns the pipeline's class name."""
    dev = s.dev
    if mode != "none" and dev.type == "cpu":
        for task in tasks:
            emit(Row(mode, task, "skipped", CPU_OFFLOAD_REASON))
        return pipeline_name
    say(f"loading {pipeline_name} on {dev} ({s.dtype_name}, offload {mode})")
    started = time.perf_counter()
    try:
        pipe = pipeload.load(s.folder, dev, DTYPES[s.dtype_name], transformer=s.swap, offload=mode,
                             svdq_compute=s.svdq_compute, text_encoder_file=s.text_encoder)
    except Exception as e:
        if not _is_oom(e):
            raise
        pipeload.release_memory(dev)
        for task in tasks:
            emit(Row(mode, task, "oom", f"out of memory while loading: {str(e).splitlines()[0]}"))
        return pipeline_name
    memory.sync()
    load_s = time.perf_counter() - started
    pipeline_name = type(pipe).__name__
    pipeload.check_size(pipe, s.width, s.height)
    accepted = inspect.signature(pipe.__call__).parameters
    kwargs = _call_kwargs(pipe, accepted, s.guidance_scale)
    for task in tasks:
        if task == "edit" and "image" not in accepted:
            emit(Row(mode, task, "skipped", f"{pipeline_name} takes no reference image", round(load_s, 3)))
            continue
        say(f"{task}, offload {mode}: {s.warmup} warm-up + {s.runs} timed run(s)")
        try:
            totals, denoise, mem = _run_task(
                pipe, task, memory, prompt=s.edit_prompt if task == "edit" else s.prompt, image=s.reference,
                width=s.width, height=s.height, steps=s.steps, runs=s.runs, warmup=s.warmup, kwargs=kwargs,
                on_run=lambda what: ran(f"{task}/{mode} {what}"), on_step=on_step)
        except Exception as e:
            if not _is_oom(e):
                raise
            pipeload.release_memory(dev)
            emit(Row(mode, task, "oom", f"out of memory: {str(e).splitlines()[0]}", round(load_s, 3),
                     memory=memory.read()))
            continue
        d = statistics.median(denoise)
        emit(Row(mode, task, "ok", None, round(load_s, 3), round(statistics.median(totals), 4), round(d, 4),
                 round(s.steps / d, 4) if d > 0 else None, [round(t, 4) for t in totals], mem))
    if hasattr(pipe, "remove_all_hooks"):
        pipe.remove_all_hooks()
    del pipe
    pipeload.release_memory(dev)
    return pipeline_name


def _document(s: _Settings, rows: list[Row], *, transformer_dir: Path, weights: str, pipeline_name: str,
              memory: _Memory, image: str | Path | None, source: Any) -> dict[str, Any]:
    """bench.json's document."""
    return {
        "tool": "flux-port", "version": __version__, "kind": "bench", "format_version": 1,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "folder": str(s.folder.resolve()), "transformer": str(transformer_dir.resolve()), "transformer_swapped": bool(
            s.swap), "weights_sha256": weights, "pipeline": pipeline_name, "device": str(s.dev),
        "device_name": _device_name(s.dev), "dtype": s.dtype_name, "memory_counter": memory.counter,
        "settings": {"width": s.width, "height": s.height, "steps": s.steps, "runs": s.runs, "warmup": s.warmup,
                     "prompt": s.prompt, "edit_prompt": s.edit_prompt,
                     "edit_image": str(image) if image is not None else "synthetic (porting.pipeline.bench.edit_image)",
                     "seed": 0, "statistic": "median"},
        **({"svdq": {"compute": s.svdq_compute, "format": source.label, "packed_bytes": source.stored_bytes()}}
           if source.svdq else {}),
        **({"text_encoder": {"file": str(s.text_encoder.path.resolve()), "slot": s.text_encoder.text_encoder
                             .architecture.slot, "format": "AWQ W4A16 (run packed)"}} if s.text_encoder else {}),
        "baseline": _relative(rows),
        "rows": [r.to_dict() for r in rows],
        "torch": torch.__version__,
    }


def bench(folder: str | Path, *, transformer: str | Path | None = None, device: str = "cpu", dtype: str | None = None,
          modes: Sequence[str] = pipeload.OFFLOADS, tasks: Sequence[str] = TASKS, size: str | int | None = None,
          steps: int | None = None, runs: int = 3, warmup: int = 1, prompt: str = DEFAULT_PROMPT,
          edit_prompt: str = EDIT_PROMPT, image: str | Path | None = None, guidance_scale: float | None = None,
          out: str | Path | None = None, force: bool = False, on_status: Callable[[str], None] | None = None,
          on_row: Callable[[Row], None] | None = None, svdq_compute: str = "w4a4",
          text_encoder: str | Path | None = None, card: bool = False) -> BenchResult:
    """Benchmark `folder` (optionally with `transformer` swapped in) and write bench.json / bench.md into `out`.
    `text_encoder`: a 4-bit text encoder file run packed; `card`: the model card's rows (`card_settings`).

    `size` defaults to 1024 on an accelerator and 256 on a CPU; compute is float32 on a CPU unless `dtype` says
    otherwise. After the first timed denoising step, a run whose estimate passes a minute says so. An SVDQuant
    `transformer` file stays packed and computes its linears as `svdq_compute` (w4a4 or w4a16)."""
    say = on_status or (lambda text: None)
    folder = Path(folder)
    swap = Path(transformer) if transformer is not None else None
    index = read_model_index(folder)
    transformer_dir = pipeload.transformer_folder(folder, swap)
    if swap is not None:
        pipeload.check_swap_fits(folder, swap)
    te_source = _open_text_encoder(folder, text_encoder, card, swap)
    dev = resolve_device(device)
    dtype_name = dtype or ("fp32" if dev.type == "cpu" else "bf16")
    if dtype_name not in DTYPES:
        raise PortError(f"--dtype {dtype_name!r}: choose one of {', '.join(DTYPES)}.")
    modes, tasks = check_choices(modes, tasks, runs, warmup)
    width, height = parse_size(default_size(dev, folder) if size is None else size)
    steps = default_steps(index, folder) if steps is None else steps
    if steps < 1:
        raise PortError(f"--steps {steps}: needs at least 1.")
    pipeload.check_memory("bench", folder, dev, dtype_name, width, height, transformer=swap)
    # the pipelines shrink a reference above 1 MP to 1 MP: the drawn one never needs to be larger
    shrink = min(1.0, (REFERENCE_AREA / (width * height)) ** 0.5)
    reference = load_references([Path(image)])[0] if image is not None else edit_image(
        max(round(width * shrink), MIN_REFERENCE_SIDE), max(round(height * shrink), MIN_REFERENCE_SIDE))
    out = Path(out) if out is not None else default_out(folder, swap)
    read_paths = {"folder": folder, "--transformer": swap, "--image": image,
                  "--text-encoder": text_encoder and Path(text_encoder)}
    check_output(out, force=force, verb="bench", inputs=read_paths)  # before the runs, not after them
    say(f"hashing the transformer weights in {transformer_dir}")
    weights = pipeload.weights_sha256(transformer_dir)
    source = pipeload.transformer_source(transformer_dir)
    memory = _Memory(dev)
    settings = _Settings(folder, swap, dev, dtype_name, width, height, steps, runs, warmup, prompt, edit_prompt,
                         reference, guidance_scale, svdq_compute, te_source)
    configs = card_settings(settings, card)

    rows: list[Row] = []
    runnable = [m for m in modes if m == "none" or dev.type != "cpu"]
    step_count = {"units": steps * (warmup + runs) * len(tasks) * len(runnable) * len(configs), "timed": False}

    def on_step(seconds: float) -> None:
        if not step_count["timed"]:
            step_count["timed"] = True
            line = estimate_line(seconds, int(step_count["units"]), "denoising step")
            if line:
                say(line)

    def emit(row: Row) -> None:
        rows.append(row)
        if on_row:
            on_row(row)

    ran = RunProgress(say, (warmup + runs) * len(tasks) * len(runnable) * len(configs))
    pipeline_name = _bench_configs(configs, modes, tasks, memory, str(index.get("_class_name")), say, emit, on_step,
                                   ran)
    doc = _document(settings, rows, transformer_dir=transformer_dir, weights=weights, pipeline_name=pipeline_name,
                    memory=memory, image=image, source=source)
    prepare_run_folder(out)
    with atomic_folder(out, force=force, verb="bench", inputs=read_paths) as staging:
        (staging / BENCH_JSON).write_text(dumps(doc, indent=2) + "\n")
        drawn = charts.write_bench_chart(doc, staging / charts.BENCH_PNG)
        (staging / BENCH_MD).write_text(to_markdown(doc, chart=charts.BENCH_PNG if drawn else None))
    return BenchResult(out, doc)


def _bench_configs(configs: list[_Settings], modes: list[str], tasks: list[str], memory: _Memory, pipeline_name: str,
                   say: Callable[[str], None], emit: Callable[[Row], None], on_step: Callable[[float], None],
                   ran: Callable[[str], None]) -> str:
    """Every offload mode of every configuration (one, or the model card's rows), each row labelled with its
    configuration; returns the pipeline's class name."""
    for config in configs:
        if config.label:
            say(f"model card row: {config.label}")

        def labelled(row: Row, label: str = config.label) -> None:
            emit(replace(row, model=label))

        for mode in modes:
            pipeline_name = _bench_mode(mode, tasks, config, memory, pipeline_name, say, labelled, on_step, ran)
    return pipeline_name


def _open_text_encoder(folder: Path, text_encoder: str | Path | None, card: bool, swap: Path | None) -> Any:
    """--text-encoder opened and checked against the folder, before anything loads; --card needs a 4-bit file."""
    if card and text_encoder is None and swap is None:
        raise PortError("--card compares the base with its 4-bit files: give --transformer (an SVDQuant file), "
                        "--text-encoder (a 4-bit text encoder), or both.")
    if text_encoder is None:
        return None
    from .text_encoder_swap import open_swap

    return open_swap(folder, Path(text_encoder))


