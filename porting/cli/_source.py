"""The input argument of a verb, resolved and opened once: the verbs branch on what the header says it is.

A recipe name (convert) stands for its fetched fine-tune file, a pipeline folder (`model_index.json`) for its
`transformer/`; what that names is opened by `porting.inputs.open_source`, headers only, and handed down as a
`Source`: the adapter sniff, the quantized layout, detection and the plan all come from that one reading. A file
that cannot be opened is reported once, with what is wrong with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ._options import transformer_of

if TYPE_CHECKING:
    from porting.inputs import Kind, Source


def resolve(arg: Path, say: Callable[[str], None], *, path: Path | None = None, kind: Kind | None = None) -> Source:
    """Open what `arg` stands for (`path` when the verb resolved it already, e.g. a recipe's fine-tune file); a
    pipeline folder is read as its transformer/, said through `say`. `kind` None: the header decides."""
    from porting.inputs import open_source

    return open_source(transformer_of(path or arg, say), kind=kind, arg=arg)
