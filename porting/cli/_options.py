"""Shared option types for every verb, and the one check every verb's options pass before it runs.

Options are what they say: a value that would silently become something else (an empty path that turns into the
current folder, a NaN threshold that every comparison fails to trip, a step count of 0 that turns into the default)
is refused with exit 2, naming the option.
"""

from __future__ import annotations

import functools
import inspect
import math
import typing
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Mapping, Optional

import typer

from porting.errors import Applies, Refusal, refuse_inapplicable


def nonempty_path(text: str) -> Path:
    """Parser of output paths: an empty string is refused (Path('') would be the current folder)."""
    if not str(text).strip():
        raise typer.BadParameter("the path is empty; name a file or folder (. is the current folder).")
    return Path(text)


def transformer_of(path: Path, say: Callable[[str], None]) -> Path:
    """A pipeline folder (one with `model_index.json`) stands for its `transformer/`: the verbs that read a
    transformer take either, and say which they used."""
    if path.is_dir() and (path / "model_index.json").is_file() and (path / "transformer").is_dir():
        say(f"{path} is a pipeline folder (model_index.json): reading its transformer/")
        return path / "transformer"
    return path


def out_option(*decls: str, help: str) -> Any:
    """A typer option naming something flux-port writes: never empty."""
    return typer.Option(*decls, help=help, parser=nonempty_path)


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout and nothing else there.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace the output folder if it exists.")]
OutDirOpt = Annotated[Path, out_option("--out", "-o", help="Output folder (written atomically).")]
OptionalOutDirOpt = Annotated[Optional[Path], out_option("--out", "-o", help="Output folder (written atomically).")]


class SvdqCompute(str, Enum):
    """How a Nunchaku SVDQuant transformer, kept packed, computes its linears."""
    w4a4 = "w4a4"
    w4a16 = "w4a16"


SvdqComputeOpt = Annotated[SvdqCompute, typer.Option(
    "--svdq-compute", help="For an SVDQuant transformer file (kept packed, run in plain torch): w4a4 computes what "
                           "the Nunchaku kernel does (inputs rounded to 4 bits per group); w4a16 multiplies "
                           "full-precision inputs by the dequantized weights.")]


class SvdqLayout(str, Enum):
    """Which file layout an SVDQuant model is written in: Nunchaku's single file, or diffusers' own folder."""
    diffusers = "diffusers"
    nunchaku = "nunchaku"


class Direction(str, Enum):
    diffusers = "diffusers"
    original = "original"


class ExportTarget(str, Enum):
    """`port export --target`: generic (dynamic axes, opset 18+) or ryzenai (AMD Ryzen AI NPU form)."""
    generic = "generic"
    ryzenai = "ryzenai"


def power_of_two_at_least(minimum: int) -> Callable[..., Any]:
    """Typer callback: an int option that must be a power of two >= `minimum` (exit 2 naming the option)."""
    def check(param: typer.CallbackParam, value: Optional[int]) -> Optional[int]:
        from porting.errors import UsageError

        if value is not None and (value < minimum or value & (value - 1)):
            raise UsageError(f"{param.opts[0]} {value}: a power of two, at least {minimum}.")
        return value

    return check


class RunDtype(str, Enum):
    """The dtype a pipeline runs in (generate, bench, compare)."""
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda[:N] or npu[:N].")]
TextEncoderOpt = Annotated[Optional[Path], typer.Option(
    "--text-encoder", help="A 4-bit text encoder file (Nunchaku's AWQ W4A16 Qwen3 or T5), run packed in place of "
                           "the folder's own; its prompt embeddings' error against the folder's encoder is "
                           "reported.")]
RunDtypeOpt = Annotated[Optional[RunDtype], typer.Option("--dtype", help="Default bf16 on accelerators, fp32 on "
                                                         "cpu (CPUs have no fast bf16 kernels).")]


class DtypeChoice(str, Enum):
    keep = "keep"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


def at_least(minimum: int) -> Callable[..., Any]:
    """Typer callback: an int option below `minimum` is refused (exit 2) naming the option and the value."""
    def check(param: typer.CallbackParam, value: Optional[int]) -> Optional[int]:
        from porting.errors import UsageError

        if value is not None and value < minimum:
            raise UsageError(f"{param.opts[0]} {value}: needs at least {minimum}.")
        return value

    return check


OrtThreadsOpt = Annotated[Optional[int], typer.Option(
    "--ort-threads", callback=at_least(1), help="onnxruntime intra-op threads (default: one per core). Its sessions "
    "open lean: external data mapped from the file, no memory arena, no prepacked weight copies.")]


StepsOpt = Annotated[Optional[int], typer.Option("--steps", callback=at_least(1), help="Denoising steps, at least 1 "
                                                 "(default 4 for distilled models, 50 otherwise).")]


WorkspaceOpt = Annotated[Optional[Path], typer.Option("--workspace", help="Workspace root holding one folder per "
                                                     "recipe (default: $FLUX_PORT_HOME, else ./ports).")]


def require_finite(value: float, option: str) -> float:
    """`value` when it is a finite number, else UsageError (exit 2) naming `option`."""
    from porting.errors import UsageError

    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{option} {value!r}: not a finite number; a NaN or infinite value would make every "
                         "comparison with it say no (or yes) whatever the numbers are.",
                         hint=f"Give {option} a finite value, or leave it out for its default.")
    return value


def _option_names(command: Callable[..., Any]) -> dict[str, str]:
    """Parameter name -> the option's first flag (or the argument's metavar) as the user typed it."""
    hints = typing.get_type_hints(command, include_extras=True)
    names = {}
    for name in inspect.signature(command).parameters:
        flag = f"--{name.rstrip('_').replace('_', '-')}"
        for meta in getattr(hints.get(name), "__metadata__", ()):
            decls = [d for d in getattr(meta, "param_decls", None) or () if d.startswith("--")]
            if decls:
                flag = decls[0]
        names[name] = flag
    return names


def checked(command: Callable[..., Any], preflight: Optional[Callable[..., None]] = None) -> Callable[..., Any]:
    """Wrap a verb so that every float option (or list of floats) holds finite numbers, and its `preflight` (the
    verb module's `preflight` function, called with the verb's options as keywords) has refused every option value
    that needs no model, before the verb runs.

    app.py registers every verb through this; int ranges are declared on the options themselves (`min=`), output
    paths go through `nonempty_path`. A preflight imports no torch, diffusers or transformers: the verb's body
    imports them (`_output.use(heavy=True)` and its engine), so a refusal costs what `port VERB --help` costs
    (tests/test_cli_refusals.py holds each verb to that).
    """
    names = _option_names(command)

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        for name, value in kwargs.items():
            for v in (value if isinstance(value, (list, tuple)) else (value,)):
                require_finite(v, names.get(name, name))
        if preflight is not None:
            preflight(**kwargs)
        return command(*args, **kwargs)

    return run


def device_option(text: Optional[str], option: str) -> None:
    """A device string (cpu, cuda[:N], npu[:N], mps, xpu[:N]) refused (exit 2, naming `option`) when malformed; its
    presence on this machine is checked where the verb resolves it."""
    from porting.devices import parse_device
    from porting.errors import DeviceError, UsageError

    if text is None:
        return
    try:
        parse_device(text)
    except DeviceError as e:
        raise UsageError(f"{option}: {e.message}", hint=e.hint) from None


# --- which options apply to which input -----------------------------------------------------------------------------

_SVDQ_ONLY = Refusal("{flag} applies to --quantize svdq-int4 / svdq-nvfp4 only.",
                     "Leave {flag} out, or add --quantize svdq-int4.")
_ADAPTERS_ONLY = Refusal("{flag}: {src} is transformer weights, not an adapter; {flag} applies to adapters only.",
                         "Leave {flag} out to convert the weights.")
_TEXT_ENCODER_NAMES = Refusal("--to applies to transformer weights; a text encoder keeps transformers' names.")
_RELAYOUT_KEEPS = Refusal("{flag}: --layout moves the packed layers as they are, in the layout's own names; {flag} "
                          "does not apply.", "Convert to bf16 first (port convert {src} --out DIR), or leave {flag} "
                                             "out.")
_SVDQ_BASES = Refusal("{flag} applies to Nunchaku SVDQuant bases; {src} is not one.", "Leave the option out.")

# verb -> option (as the verb names it in `given`) -> the kinds of input it applies to (`Applies`: what it says
# elsewhere, and any option it needs), checked in this order. Kinds: `adapter` (LoRA / LyCORIS factors) and
# `weights`; convert's weights split by --quantize into `svdq` (svdq-*), `quantized` (gguf-* / fp8-scaled) and
# `weights` (none; `convert_kind`); merge's base is `svdq` (a Nunchaku SVDQuant file) or `weights`. batch checks
# each job's convert options against the same table (batch/jobs.py: check_applicable_options).
APPLIES: dict[str, dict[str, Applies]] = {
    "convert": {
        # first: an option that writes another kind of file is the true reason a related option does not apply
        "--quantize": Applies(frozenset({"svdq", "quantized", "awq"}), Refusal(
            "--quantize {quantize}: {src} is an adapter (LoRA / LyCORIS factors); --quantize writes quantized "
            "transformer weights.", "Merge the adapter into a base first (port merge), then quantize the result."),
            per_kind={
                "awq_weights": Refusal("--quantize awq-int4 writes a 4-bit text encoder (Qwen3, T5); {src} is "
                                       "transformer weights.", "For a transformer: --quantize svdq-int4."),
                "text_encoder_other": Refusal("--quantize {quantize}: {src} is a text encoder; the transformer "
                                              "formats do not apply to it.",
                                              "port convert {src} --quantize awq-int4 --out DIR")},
            needs={"quantized": ("--to original", Refusal(
                "--quantize {quantize} writes original (BFL) naming for ComfyUI-style loaders; it needs --to "
                "original.", "port convert {src} --to original --quantize {quantize} {out}"))}),
        "--lora-style": Applies(frozenset({"adapter"}), _ADAPTERS_ONLY),
        "--materialise": Applies(frozenset({"adapter"}), _ADAPTERS_ONLY),
        "--rank": Applies(frozenset({"svdq"}), _SVDQ_ONLY),
        "--calibrate": Applies(frozenset({"svdq"}), _SVDQ_ONLY),
        "--verbose": Applies(frozenset({"svdq"}), _SVDQ_ONLY),
        "--layout": Applies(frozenset({"svdq", "relayout"}), Refusal(
            "{flag}: {src} is not an SVDQuant model (Nunchaku's file or diffusers' Nunchaku folder); --layout "
            "applies to one, or to --quantize svdq-int4 / svdq-nvfp4.",
            "port convert {src} --quantize svdq-int4 {flag} {out}")),
        "--device": Applies(frozenset({"svdq"}), _SVDQ_ONLY, needs={"svdq": ("--calibrate", Refusal(
            "--device says where --calibrate runs the model; without --calibrate nothing runs."))}),
        "--to original": Applies(frozenset({"adapter", "weights", "quantized"}), Refusal(
            "--quantize {quantize} writes Nunchaku's own layer names; --to does not apply.",
            "port convert {src} --quantize {quantize} --out DIR"), per_kind={
            "text_encoder": _TEXT_ENCODER_NAMES, "awq": _TEXT_ENCODER_NAMES, "relayout": _RELAYOUT_KEEPS}),
        "--dtype": Applies(frozenset({"weights", "quantized"}), Refusal(
            "--quantize {quantize} writes 4-bit layers and bf16 for the rest; --dtype does not apply."), per_kind={
            "adapter": Refusal("--dtype applies to weights; a converted adapter keeps its factors' dtype.",
                               usage=False),
            "text_encoder": Refusal("--dtype: a text encoder is written in bf16 (its 4-bit layers dequantized); "
                                    "--dtype does not apply."), "relayout": _RELAYOUT_KEEPS}),
    },
    "inspect": {
        "--strength": Applies(frozenset({"adapter"}), Refusal(
            "--strength is for an adapter measured against a base (port inspect ADAPTER --base BASE)."),
            needs={"adapter": ("--base", Refusal("--strength needs --base: the delta is measured against a base's "
                                                 "weights.", "port inspect {src} --base BASE --strength {strength}"))}),
    },
    "merge": {
        "--requantize": Applies(frozenset({"svdq"}), _SVDQ_BASES),
        "--max-error": Applies(frozenset({"svdq"}), _SVDQ_BASES),
    },
}


def check_applicable(verb: str, kind: str, given: Mapping[str, Optional[str]], **fields: Any) -> None:
    """Refuse (exit 2) the first option in `given` that does not apply to `kind` in `APPLIES[verb]`, or that lacks
    an option it needs. `given`: option -> how it was given (e.g. `--lora-style kohya`), None when it was not."""
    refuse_inapplicable(APPLIES[verb], kind, given, **fields)


def convert_kind(source_kind: str, quantize: Optional[str]) -> str:
    """The kind `APPLIES["convert"]` knows: adapter, or weights written plain (weights), as Nunchaku SVDQuant (svdq)
    or as one gguf / fp8 file (quantized); a text encoder written bf16 (text_encoder) or 4-bit (awq)."""
    if source_kind == "adapter":
        return "adapter"
    if source_kind == "text_encoder":
        return "awq" if quantize == "awq-int4" else "text_encoder" if quantize is None else "text_encoder_other"
    if quantize is None:
        return "weights"
    if quantize == "awq-int4":
        return "awq_weights"
    return "svdq" if quantize.startswith("svdq-") else "quantized"


def convert_given(*, lora_style: Optional[str] = None, materialise: bool = False, rank: Optional[int] = None,
                  calibrate: Any = None, device: str = "cpu", to: str = "diffusers", dtype: str = "keep",
                  quantize: Optional[str] = None, verbose: bool = False,
                  layout: Optional[str] = None) -> dict[str, Optional[str]]:
    """`port convert`'s options as `check_applicable` takes them: each shown as given, None when left at its
    default."""
    return {"--lora-style": None if lora_style is None else f"--lora-style {lora_style}",
            "--materialise": "--materialise" if materialise else None,
            "--rank": None if rank is None else "--rank",
            "--calibrate": None if calibrate is None else "--calibrate",
            "--verbose": "--verbose" if verbose else None,
            "--device": "--device" if device != "cpu" else None,
            "--to original": "--to original" if to == "original" else None,
            "--dtype": "--dtype" if dtype != "keep" else None,
            "--quantize": None if quantize is None else f"--quantize {quantize}",
            "--layout": None if layout is None else f"--layout {layout}"}
