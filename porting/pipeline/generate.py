"""`port generate`: run a published folder through its diffusers pipeline and measure it.

Loads with `DiffusionPipeline.from_pretrained(folder, local_files_only=True)` (the class comes from
model_index.json), draws the noise from a CPU generator so a seed gives the same image on every device, and times
loading and denoising; peak memory is the device allocator's peak on an accelerator, the process peak RSS on CPU.
"""

from __future__ import annotations

import inspect
import os
import resource
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from porting._files import read_json_object
from porting.devices import resolve_device
from porting.errors import InputError, OutputExistsError, PortError
from porting.outputs import (
    UnsafeOutputError,
    check_disjoint,
    check_writable_parent,
    sibling_prefix,
    umask,
    write_error,
)
from porting.ownership import file_is_flux_ports, require_key, write_file_record
from porting.paths import check_component_names
from porting.progress import debug

from .run_options import parse_size  # noqa: F401  (generate.parse_size: compare and bench take it from here)


def progress_clock() -> float:
    """The clock step times are read from (porting.progress.clock, which tests replace)."""
    from porting import progress

    return progress.clock()

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OFFLOAD_MODES = ("model", "sequential")
MIN_REFERENCE_SIDE = 64  # Flux2 pipelines refuse smaller reference images (flux2-checkpoints.md 8.1)
# the largest reference image flux-port decodes: the Flux2 pipelines shrink any reference above 1 MP to 1 MP, and a
# header claiming more is a decompression bomb (PIL's own limit, Image.MAX_IMAGE_PIXELS, is 89 MP)
MAX_REFERENCE_PIXELS = 8192 * 8192
REFERENCE_AREA = 1024 * 1024  # what the pipelines resize a larger reference image to
DEFAULT_SIZE = 1024  # on an accelerator
CPU_PATCHES = 16  # on a CPU: 16 x 16 = 256 image tokens, a size that finishes in seconds to minutes
CPU_DEFAULT_SIZE = CPU_PATCHES * 2 * 8  # 256 px for the FLUX.2 / FLUX.1 VAEs (factor 8, 2x2 patches)


def vae_scale_factor(folder: Path | None) -> int:
    """The pipeline's VAE factor from vae/config.json (2 ** (levels - 1)); 8, the FLUX VAEs', when unknown."""
    try:
        levels = read_json_object(Path(folder) / "vae" / "config.json", "VAE config")["block_out_channels"]
        return 2 ** (len(levels) - 1) if isinstance(levels, list) and 0 < len(levels) <= 8 else 8
    except (InputError, KeyError, TypeError):
        return 8


def default_size(device: torch.device | str, folder: Path | None = None) -> int:
    """The side `--size` defaults to: 1024 on an accelerator; on a CPU, 16 x 16 latent patches (256 px for the
    FLUX VAEs, less for a pipeline with a smaller VAE, such as the demo's)."""
    if torch.device(device).type != "cpu":
        return DEFAULT_SIZE
    return CPU_PATCHES * 2 * vae_scale_factor(folder) if folder is not None else CPU_DEFAULT_SIZE


@dataclass
class GenerateResult:
    output: str
    pipeline: str
    prompt: str
    width: int
    height: int
    steps: int
    seed: int
    device: str
    dtype: str
    cpu_offload: str | None
    reference_images: list[str]
    load_s: float
    denoise_s: float
    s_per_it: float
    total_s: float
    peak_memory_bytes: int
    peak_memory_kind: str  # "device allocator" or "process RSS"
    transformer_runtime: str = "torch"  # or "onnxruntime:<provider>" for an ONNX export folder
    text_encoder: dict[str, Any] | None = None  # --text-encoder: the file and its prompt embeddings' error

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_model_index(folder: Path) -> dict[str, Any]:
    path = folder / "model_index.json"
    if not path.is_file():
        raise InputError(f"{folder}: no model_index.json; not a diffusers pipeline folder.",
                         hint="Publish one first: port publish --base BASE --transformer DIR --out FOLDER.")
    index = read_json_object(path, "a diffusers pipeline folder has one at its root")
    check_component_names(index, path)  # diffusers loads each component from the folder of that name
    return index


def default_steps(index: dict[str, Any], folder: Path | None = None) -> int:
    """4 for a base whose model_index.json says it is distilled; else the steps of the folder's publish variant
    (the family registry: 4 for klein KV and FLUX.1 [schnell], 28 for FLUX.1 [dev]); 50 when unknown.
    `folder` tells variants sharing a pipeline class apart by the transformer's guidance embedding."""
    from .variants import folder_variant

    if index.get("is_distilled"):
        return 4
    spec = folder_variant(index, folder)
    return spec.default_steps if spec is not None else 50


def call_parameters(index: dict[str, Any]) -> Any:
    """The `__call__` parameters of the pipeline class model_index.json names (None for a class diffusers lacks):
    what a verb asks before loading anything, instead of knowing which pipelines take what."""
    import diffusers

    try:
        cls = getattr(diffusers, str(index.get("_class_name")))
    except (AttributeError, ImportError, RuntimeError):
        return None
    return inspect.signature(cls.__call__).parameters if isinstance(cls, type) else None


def check_takes_images(index: dict[str, Any], images: Sequence[Any]) -> None:
    """Refuse --image (exit 2, before any image is read) for a pipeline without a reference-image input."""
    if not images:
        return
    accepted = call_parameters(index)
    if accepted is not None and "image" not in accepted:
        raise PortError(f"--image: {index.get('_class_name')} takes no reference image (text-to-image only).",
                        hint="Drop --image, or use a pipeline with image editing.")


def reference_size(path: Path) -> tuple[int, int]:
    """Width and height of a reference image from its header, before anything is decoded; refuses by name a file
    that is missing, unreadable, too small, or larger than MAX_REFERENCE_PIXELS (a decompression bomb included)."""
    from PIL import Image

    if not Path(path).is_file():
        raise InputError(f"--image {path}: no such file.")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                width, height = img.size
    except Image.DecompressionBombError as e:
        raise InputError(f"--image {path}: larger than the {MAX_REFERENCE_PIXELS:,} pixels flux-port decodes "
                         f"({e}).", hint="Resize the reference image; the pipeline shrinks it to 1 MP anyway.") from e
    except (OSError, ValueError) as e:
        raise InputError(f"--image {path}: not an image PIL can read ({e}).") from e
    if width * height > MAX_REFERENCE_PIXELS:
        raise InputError(f"--image {path}: {width}x{height} px ({width * height / 1e6:.0f} MP) is larger than the "
                         f"{MAX_REFERENCE_PIXELS / 1e6:.0f} MP flux-port decodes for a reference image.",
                         hint="Resize the reference image; the pipeline shrinks it to 1 MP anyway.")
    if min(width, height) < MIN_REFERENCE_SIDE:
        raise InputError(f"--image {path}: {width}x{height} px; reference images need at least "
                         f"{MIN_REFERENCE_SIDE} px per side.")
    return width, height


def reference_tokens(sizes: Sequence[tuple[int, int]]) -> int:
    """Transformer tokens the reference images add (each shrunk to 1 MP at most, VAE /8, 2x2 patches)."""
    return sum(min(w * h, REFERENCE_AREA) // 256 for w, h in sizes)


def load_references(paths: Sequence[Path]) -> list[Any]:
    from PIL import Image

    for p in paths:  # every header first: nothing is decoded before all of them are known to be fine
        reference_size(Path(p))
    images = []
    for p in paths:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                images.append(Image.open(p).convert("RGB"))
        except (OSError, ValueError, Image.DecompressionBombError) as e:
            raise InputError(f"--image {p}: not an image PIL can read ({e}).") from e
    return images


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _accelerator(device: torch.device) -> Any | None:
    return {"cuda": getattr(torch, "cuda", None), "npu": getattr(torch, "npu", None),
            "xpu": getattr(torch, "xpu", None)}.get(device.type)


PNG_SOFTWARE = "flux-port"  # a courtesy text chunk naming the tool; it proves nothing (anyone can write one)


def check_image_replaceable(output: Path, force: bool = False) -> None:
    """An existing --output is replaced only with --force, and only when the sealed record of this machine's
    flux-port proves it wrote that very file (docs/outputs.md); never a user's file or a link."""
    check_writable_parent(output)
    require_key()
    if output.is_symlink() or (output.exists() and not output.is_file()):
        raise UnsafeOutputError(f"--output {output}: exists and is not a plain file; flux-port will not replace it.",
                                hint="Choose another --output.")
    if not output.exists():
        return
    if not file_is_flux_ports(output):
        raise UnsafeOutputError(f"--output {output}: the file exists and was not written by flux-port (no sealed "
                                "record of this machine's flux-port for this very file: a copy, an edit, or a "
                                "file merely tagged Software=flux-port proves nothing); nothing was changed.",
                                hint="Choose another --output, or move that file away.")
    if not force:
        raise OutputExistsError(f"--output {output}: the file already exists; nothing was changed.",
                                hint="Pass --force to replace it (only an image flux-port wrote), or choose another "
                                     "--output.")


def save_png(image: Any, output: Path) -> None:
    """Write the PNG next to `output`, record it (sealed) as flux-port's, and rename it into place."""
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("Software", PNG_SOFTWARE)
    output.parent.mkdir(parents=True, exist_ok=True)
    # never a user's file's name; within 255 bytes for a long --output name
    fd, name = tempfile.mkstemp(prefix=sibling_prefix(output, "partial"), dir=output.parent)
    os.close(fd)
    partial = Path(name)
    try:
        os.chmod(partial, 0o666 & ~umask())
        image.save(partial, format="PNG", pnginfo=info)
        write_file_record(partial, "generate", destination=output)
        os.replace(partial, output)
    except OSError as e:
        partial.unlink(missing_ok=True)
        raise write_error(output, e) from e
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def _check_offload(cpu_offload: str | None, dev: torch.device, onnx: bool) -> None:
    """--cpu-offload: a known mode, on an accelerator, for a torch transformer."""
    if cpu_offload is None:
        return
    if cpu_offload not in OFFLOAD_MODES:
        raise PortError(f"--cpu-offload {cpu_offload!r}: choose model or sequential.")
    if dev.type == "cpu":
        raise PortError("--cpu-offload moves weights between CPU and an accelerator; it needs --device cuda or "
                        "npu:N.")
    if onnx:
        raise PortError("--cpu-offload moves torch weights; the ONNX transformer runs in onnxruntime.")


def _check_transformer(folder: Path, onnx_source: Path | None, swap: Path | None, ort_threads: int | None,
                       dev: torch.device, dtype_name: str, size: tuple[int, int],
                       references: list[tuple[int, int]]) -> None:
    """--transformer and --ort-threads fit the folder's runtime; a torch pipeline fits in memory."""
    if swap is not None and onnx_source is not None:
        raise PortError("--transformer swaps a torch transformer; this folder's transformer is an ONNX export.")
    if ort_threads is not None and onnx_source is None:
        raise PortError(f"--ort-threads {ort_threads}: this folder's transformer runs in torch; the option is for an "
                        "ONNX export folder (port export).")
    if onnx_source is None:
        from porting.pipeline.pipeload import check_memory, check_swap_fits

        if swap is not None:
            check_swap_fits(folder, swap)
        check_memory("generating", folder, dev, dtype_name, size[0], size[1], transformer=swap,
                     extra_tokens=reference_tokens(references))


def _load(folder: Path, onnx_source: Path | None, dev: torch.device, dtype: torch.dtype, *, provider: str,
          ort_threads: int | None, size: tuple[int, int], cpu_offload: str | None, swap: Path | None,
          svdq_compute: str, say: Callable[[str], None], text_encoder: Any | None = None) -> Any:
    """The pipeline: an ONNX export's transformer in onnxruntime with the rest in torch, or all of it in torch."""
    if onnx_source is not None:
        from porting.pipeline.ort_pipeline import load_onnx_pipeline

        say(f"transformer: onnxruntime {provider} on {folder / 'transformer'}; the rest: torch from {onnx_source}")
        from porting.export.ort import SessionSettings

        return load_onnx_pipeline(folder, dtype, provider, SessionSettings(threads=ort_threads), size=size).to(dev)
    from .pipeload import load

    return load(folder, dev, dtype, transformer=swap, offload=cpu_offload or "none", svdq_compute=svdq_compute,
                text_encoder_file=text_encoder)


def _check_text_encoder(folder: Path, onnx_source: Path | None, text_encoder: str | Path | None) -> Any | None:
    """--text-encoder opened and checked against the folder (before anything loads), or None."""
    if text_encoder is None:
        return None
    if onnx_source is not None:
        raise PortError("--text-encoder swaps a torch text encoder; give it with the torch pipeline folder.")
    from .text_encoder_swap import open_swap

    return open_swap(folder, Path(text_encoder))


def text_encoder_report(pipe: Any, folder: Path, source: Any, prompts: Sequence[str],
                        dtype: torch.dtype) -> dict[str, Any]:
    """The 4-bit text encoder a pipeline runs and its prompt embeddings' error against the folder's own encoder."""
    from .text_encoder_swap import embedding_error, own_encoder

    slot = source.text_encoder.architecture.slot
    error = embedding_error(pipe, slot, own_encoder(folder, slot, dtype), prompts)
    return {"file": str(source.path), "slot": slot, "prompts": len(prompts), "embedding_rel_l2": error}


def _call(pipe: Any, *, prompt: str, width: int, height: int, steps: int, seed: int, references: list[Any],
          guidance_scale: float | None, on_step: Callable[[int, int, float], None] | None,
          say: Callable[[str], None]) -> tuple[Any, float, float]:
    """Run the pipeline once; returns (the image, seconds of the whole call, seconds of the denoising loop: first
    transformer call to last step)."""
    multiple = getattr(pipe, "vae_scale_factor", 8) * 2
    if width % multiple or height % multiple:
        raise PortError(f"--size {width}x{height}: both sides must be multiples of {multiple} for this pipeline.",
                        hint=f"e.g. --size {max(multiple, width // multiple * multiple)}")

    marks: dict[str, float] = {}

    def first_forward(module: Any, args: Any) -> None:
        marks.setdefault("denoise_start", time.perf_counter())
        marks.setdefault("step_start", progress_clock())

    def step_end(pipeline: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        marks["denoise_end"] = time.perf_counter()
        now = progress_clock()
        if on_step is not None:
            on_step(i + 1, steps, now - marks.get("step_start", now))
        marks["step_start"] = now
        return kwargs

    handle = pipe.transformer.register_forward_pre_hook(first_forward)
    accepted = inspect.signature(pipe.__call__).parameters
    kwargs: dict[str, Any] = {"prompt": prompt, "height": height, "width": width, "num_inference_steps": steps,
                              "generator": torch.Generator("cpu").manual_seed(seed),
                              "callback_on_step_end": step_end}
    if references:
        kwargs["image"] = references if len(references) > 1 else references[0]
    if guidance_scale is not None:
        if "guidance_scale" not in accepted:
            raise PortError(f"--guidance-scale: {type(pipe).__name__} takes no guidance scale.")
        kwargs["guidance_scale"] = guidance_scale
    elif "guidance_scale" in accepted and getattr(pipe.config, "is_distilled", False):
        kwargs["guidance_scale"] = 1.0  # distilled models ignore guidance; 1.0 spares the pipeline's warning about it
    say(f"generating {width}x{height}, {steps} step(s), seed {seed}")
    call_start = time.perf_counter()
    try:
        image = pipe(**kwargs).images[0]
    finally:
        handle.remove()
    total_s = time.perf_counter() - call_start
    return image, total_s, marks.get("denoise_end", call_start) - marks.get("denoise_start", call_start)


def generate(folder: str | Path, prompt: str, *, device: str = "cpu", steps: int | None = None, seed: int = 0,
             size: str | int | None = None, output: str | Path = "image.png", cpu_offload: str | None = None,
             images: Sequence[str | Path] = (), dtype: str | None = None, guidance_scale: float | None = None,
             progress: bool = True, on_status: Callable[[str], None] | None = None,
             provider: str = "CPUExecutionProvider", force: bool = False, ort_threads: int | None = None,
             on_step: Callable[[int, int, float], None] | None = None, transformer: str | Path | None = None,
             svdq_compute: str = "w4a4", text_encoder: str | Path | None = None) -> GenerateResult:
    """Generate one image from a published folder and write it as PNG to `output`.

    `size` defaults to 1024 on an accelerator and CPU_DEFAULT_SIZE on a CPU; compute is float32 on a CPU unless
    `dtype` says otherwise. `on_step(done, total, seconds)` is called after each denoising step (`seconds`: that
    step's time). diffusers' own progress bar shows only with `progress` and FLUX_PORT_DEBUG=1.

    An ONNX export folder (`port export`) runs its transformer in onnxruntime with `provider`; the other components
    come from the source pipeline folder its manifest names and run in torch.

    `transformer` replaces the folder's own: a transformer folder, or a Nunchaku SVDQuant file kept packed and
    computed as `svdq_compute` (w4a4: the kernel's 4-bit activations; w4a16: the dequantized weights).
    `text_encoder`, a 4-bit text encoder file, runs packed in its slot; its prompt embeddings' error against the
    folder's own encoder is in the result.
    """
    from porting.pipeline.ort_pipeline import export_source

    folder, output = Path(folder), Path(output)
    say = on_status or (lambda text: None)
    onnx_source = export_source(folder)
    index = read_model_index(onnx_source or folder)
    dev = resolve_device(device)
    _check_offload(cpu_offload, dev, onnx_source is not None)
    dtype_name = dtype or ("fp32" if dev.type == "cpu" else "bf16")
    if dtype_name not in DTYPES:
        raise PortError(f"--dtype {dtype_name!r}: choose one of {', '.join(DTYPES)}.")
    width, height = parse_size(default_size(dev, onnx_source or folder) if size is None else size)
    check_takes_images(index, images)
    sizes = [reference_size(Path(p)) for p in images]
    steps = default_steps(index, onnx_source or folder) if steps is None else steps
    if steps < 1:
        raise PortError(f"--steps {steps}: needs at least 1.")
    swap = Path(transformer) if transformer is not None else None
    _check_transformer(folder, onnx_source, swap, ort_threads, dev, dtype_name, (width, height), sizes)
    te_source = _check_text_encoder(folder, onnx_source, text_encoder)
    references = load_references([Path(p) for p in images])
    if output.suffix.lower() != ".png":
        raise PortError(f"--output {output}: flux-port writes PNG; name the file *.png.")
    check_disjoint(output, {"pipeline folder": folder, "source pipeline": onnx_source, "--image": list(images),
                            "--transformer": swap, "--text-encoder": text_encoder and Path(text_encoder)})
    check_image_replaceable(output, force)

    acc = _accelerator(dev)
    if acc is not None:
        acc.reset_peak_memory_stats(dev)
    say(f"loading {index.get('_class_name')} from {folder} on {dev} ({dtype_name}"
        + (f", {cpu_offload} offload" if cpu_offload else "") + ")")
    started = time.perf_counter()
    pipe = _load(folder, onnx_source, dev, DTYPES[dtype_name], provider=provider, ort_threads=ort_threads,
                 size=(width, height), cpu_offload=cpu_offload, swap=swap, svdq_compute=svdq_compute, say=say,
                 text_encoder=te_source)
    pipe.set_progress_bar_config(disable=not (progress and debug()))
    load_s = time.perf_counter() - started

    image, total_s, denoise_s = _call(pipe, prompt=prompt, width=width, height=height, steps=steps, seed=seed,
                                      references=references, guidance_scale=guidance_scale, on_step=on_step, say=say)

    save_png(image, output)

    if acc is not None:
        peak, kind = int(acc.max_memory_allocated(dev)), "device allocator"
    else:
        peak, kind = _peak_rss_bytes(), "process RSS"
    te_report = None  # measured after the peak: it loads the folder's own encoder beside the packed one
    if te_source is not None:
        te_report = text_encoder_report(pipe, folder, te_source, [prompt], DTYPES[dtype_name])
    return GenerateResult(
        output=str(output), pipeline=type(pipe).__name__, prompt=prompt, width=width, height=height, steps=steps,
        seed=seed, device=str(dev), dtype=dtype_name, cpu_offload=cpu_offload,
        reference_images=[str(p) for p in images], load_s=round(load_s, 3), denoise_s=round(denoise_s, 3),
        s_per_it=round(denoise_s / steps, 4), total_s=round(total_s, 3), peak_memory_bytes=peak,
        peak_memory_kind=kind,
        transformer_runtime=f"onnxruntime:{provider}" if onnx_source is not None else "torch",
        text_encoder=te_report)
