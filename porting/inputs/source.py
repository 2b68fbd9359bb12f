"""What flux-port reads: one `Source` per input, opened once and handed down (the mirror of `outputs.py`).

A checkpoint given to a verb is opened here, once: its headers are read (and a quantized layout decoded) by
`porting.tensors.checkpoint.open_checkpoint`, each file is stamped, and the header says what the input is (transformer
weights or an adapter). Everything after that (detection, the plan, an adapter's modules, placement, writing, the
weights identity) works on that one reading; nothing below opens the file again.

Entry points take a `Source` or a path (`SourceLike`, "path or opened" as diffusers' `from_single_file` takes a
path or a state dict): `as_source` opens a path and passes a `Source` through. Outside `porting/tensors/`, this module
is the only caller of `open_checkpoint` (tests/test_architecture.py holds that).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Mapping, Union

from porting.errors import InputError, InternalError
from porting.families.mapping import MappingTable
from porting.inputs.adapter_keys import Adapter, looks_like_adapter, read_adapter
from porting.inputs.detect import Detection, detect
from porting.inputs.text_encoders import (
    Architecture,
    TextEncoder,
    looks_like_text_encoder,
    open_text_encoder,
)
from porting.inputs.text_encoders import recognise as recognise_text_encoder
from porting.tensors import checkpoint
from porting.tensors.checkpoint import Checkpoint, hash_checkpoint

Kind = Literal["weights", "adapter", "text_encoder"]
Stamp = tuple[int, int, int]  # (inode, size, mtime_ns): a writer replacing or rewriting a file changes it


@dataclass(frozen=True)
class Source:
    """One opened input: what was typed, what was opened, its files and their stamps, and what the header says.

    `view` is the checkpoint as opened (stored keys; a quantized layout already decoded). `detection` (weights) and
    `adapter` (adapters) are worked out from it on first use, once, under the settings the source was opened with;
    `detect()` and `read_adapter()` give them under other settings from the same reading.
    """

    arg: Path  # what the user typed (a recipe name, a pipeline folder, a file)
    path: Path  # what was opened
    view: Checkpoint
    kind: Kind
    stamps: Mapping[Path, Stamp]  # every file, stamped as its header was read
    base_config: Mapping[str, Any] | None = field(default=None, repr=False)  # --config, for `detection`
    tables: Mapping[str, MappingTable] | None = field(default=None, repr=False)  # tables replacing the built-in ones
    prefer: str | None = field(default=None, repr=False)  # adapters: the family that wins ties (the base's)

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(self.view.files)

    @cached_property
    def detection(self) -> Detection:
        """Transformer weights: table, naming, prefix, variant and config (with `base_config`); `.ckpt` is the
        view spelled as the table spells it."""
        found = recognise_text_encoder(self.view) if self.kind != "adapter" else None
        if found is not None:  # a transformer verb given a text encoder (whatever kind it was opened as)
            raise not_a_transformer(self.path, found[0])
        if self.kind != "weights":
            raise InternalError(f"{self.path}: detection asked of an adapter source.")
        return detect(self.view, self.base_config, self.tables)

    @cached_property
    def text_encoder(self) -> TextEncoder:
        """A text encoder's architecture, config (checked against the tensors) and 4-bit layers."""
        if self.kind != "text_encoder":
            raise InternalError(f"{self.path}: text-encoder facts asked of a {self.kind} source.")
        return open_text_encoder(self.view)

    @cached_property
    def adapter(self) -> Adapter:
        """An adapter's keys sorted into modules of the best table (ties to `prefer`)."""
        if self.kind != "adapter":
            raise InternalError(f"{self.path}: adapter modules asked of a weights source.")
        return read_adapter(self.view, prefer=self.prefer)

    @property
    def family(self) -> str:
        """The registry name of the family: detected for weights, best-scored for adapters."""
        return (self.detection if self.kind == "weights" else self.adapter).table.name

    def detect(self, base_config: Mapping[str, Any] | None = None,
               tables: Mapping[str, MappingTable] | None = None) -> Detection:
        """`detection` under another base config or other tables, from the same reading (no file is read)."""
        if base_config == self.base_config and tables is self.tables:
            return self.detection
        return detect(self.view, base_config, tables)

    def read_adapter(self, table: MappingTable | None = None, prefer: str | None = None) -> Adapter:
        """`adapter` sorted by `table`, or with ties going to `prefer`, from the same reading (only alphas are
        read: they are tensors). A preference for the family that won already changes nothing: the same modules."""
        if table is None and self.kind == "adapter" and (
                prefer == self.prefer or (prefer is not None and self.adapter.table.name == prefer)):
            return self.adapter
        return read_adapter(self.view, table, prefer)

    @cached_property
    def weights_sha256(self) -> str:
        """The weights identity of the tensors as stored (what `port convert` records for the folder it writes),
        read once per source and recorded (porting.known_digests: the first verb that names the weights, validate
        say, records them for the others); not read at all for files still as when their identity was recorded.
        Tensors whose sha256 is recorded (port fetch, convert) are not read either."""
        from porting.known_digests import weights_of

        return weights_of(self.view.files, lambda: hash_checkpoint(self.view))

    def check_unchanged(self) -> None:
        """Refuse when a file changed since its header was read (replaced, rewritten, truncated)."""
        now = stamp_files(self.view.files)
        changed = [f for f in self.stamps if self.stamps[f] != now.get(f)]
        if changed:
            raise InputError(f"{changed[0]}: the source changed while it was being converted (size, time or file "
                             "replaced); the output mixes two versions, so nothing was written.",
                             hint="Convert again once nothing is writing to the source.")


def not_a_transformer(path: Path, arch: Architecture) -> InputError:
    return InputError(f"{path}: a {arch.label}, not a diffusion transformer; this verb takes a transformer.",
                      hint=f"port convert {path} --out DIR writes it as a bf16 transformers folder that "
                           f"{arch.pipelines} loads; generate, compare and bench run a 4-bit one with --text-encoder.")


SourceLike = Union[Source, str, "os.PathLike[str]"]


def shown(src: SourceLike) -> str | os.PathLike[str]:
    """What messages and documents call `src`: the path as the caller gave it, or an opened source's path."""
    return src.path if isinstance(src, Source) else src


def stamp_files(files: list[Path] | tuple[Path, ...]) -> dict[Path, Stamp]:
    """(inode, size, mtime_ns) of each file; a file gone is left out (and so differs from its stamp)."""
    stamps = {}
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            continue
        stamps[Path(f)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return stamps


def open_source(path: str | os.PathLike[str], *, base_config: Mapping[str, Any] | None = None,
                prefer: str | None = None, tables: Mapping[str, MappingTable] | None = None,
                kind: Kind | None = None, arg: str | os.PathLike[str] | None = None) -> Source:
    """Open `path` (a file, a sharded folder or a diffusers model folder), headers only, and stamp its files.

    `kind` None: an adapter when most keys are adapter factors, else weights; given, the file is read as that.
    `base_config` and `tables` are what `detection` uses, `prefer` what `adapter` uses. `arg` is what the user typed
    when `path` was resolved from it (a recipe name, a pipeline folder).
    """
    view = checkpoint.open_checkpoint(path)  # through the module: one seam that tests can wrap
    stamps = stamp_files(view.files)  # right after the headers were read: the writer checks against these
    if kind is None:
        kind = ("adapter" if looks_like_adapter(view) else
                "text_encoder" if looks_like_text_encoder(view) else "weights")
    return Source(Path(arg if arg is not None else path), Path(path), view, kind, stamps, base_config, tables, prefer)


def as_source(src: SourceLike, *, base_config: Mapping[str, Any] | None = None, prefer: str | None = None,
              tables: Mapping[str, MappingTable] | None = None, kind: Kind | None = None) -> Source:
    """A path opened with `open_source`; a `Source` as it is, or re-read as `kind` or with the settings given where
    they differ from its own (no file is read again; a setting left None keeps the source's)."""
    if not isinstance(src, Source):
        return open_source(src, base_config=base_config, prefer=prefer, tables=tables, kind=kind)
    wanted = (kind or src.kind, src.base_config if base_config is None else base_config,
              src.tables if tables is None else tables, src.prefer if prefer is None else prefer)
    if wanted == (src.kind, src.base_config, src.tables, src.prefer):
        return src
    return replace(src, kind=wanted[0], base_config=wanted[1], tables=wanted[2], prefer=wanted[3])
