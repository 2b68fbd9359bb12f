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
from typing import Annotated, Any, Callable, Optional

import typer


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


def checked(command: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a verb so that every float option (or list of floats) holds finite numbers before the verb runs.

    app.py registers every verb through this; int ranges are declared on the options themselves (`min=`), output
    paths go through `nonempty_path`.
    """
    names = _option_names(command)

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        for name, value in kwargs.items():
            for v in (value if isinstance(value, (list, tuple)) else (value,)):
                require_finite(v, names.get(name, name))
        return command(*args, **kwargs)

    return run
