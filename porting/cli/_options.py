"""Shared option types for every verb."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document to stdout and nothing else there.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace the output folder if it exists.")]
OutDirOpt = Annotated[Path, typer.Option("--out", "-o", help="Output folder (written atomically).")]
OptionalOutDirOpt = Annotated[Optional[Path], typer.Option("--out", "-o", help="Output folder (written atomically).")]


class Direction(str, Enum):
    diffusers = "diffusers"
    original = "original"


class DtypeChoice(str, Enum):
    keep = "keep"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


WorkspaceOpt = Annotated[Optional[Path], typer.Option("--workspace", help="Workspace root holding one folder per "
                                                     "recipe (default: $FLUX_PORT_HOME, else ./ports).")]
