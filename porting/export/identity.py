"""The identity of every component an export uses, recorded when it is made and checked before it is used.

An ONNX export runs its own graphs but borrows the rest of the pipeline (text encoders, tokenizers, VAE, scheduler,
the transformer's config) from the source folder its manifest names. Both can change after the export: a rerun of
`port demo --family flux2-dev` rewrites the source folder with another model, and an unchecked `port generate` would
combine the exported klein transformer with FLUX.2 [dev]'s text encoder and VAE.

A component's identity is a sha256 over its files' relative paths, sizes and sampled contents: a file up to
2 x SAMPLE bytes whole (configs, tokenizers, scheduler), a larger one by its first and last SAMPLE bytes (a
safetensors file's first bytes are its header: every tensor's name, dtype, shape and offsets). It reads at most
2 MiB per file, so checking a klein-9B export costs milliseconds where a full sha256 would read tens of GB before
every image. It is the content, not the file times: a rerun that rewrites identical bytes (the same demo twice, a
`cp` without `-p`) keeps the identity. What it cannot see is an edit inside a large file that keeps its size, its
header and its first and last MiB; a new model or a retrained one changes all of these, and `port validate` reads
the source transformer's whole weights against the sha256 the export recorded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping

from porting._files import read_json_object
from porting.errors import InputError

SAMPLE = 1 << 20
SKIPPED_PREFIX = ".flux-port-"  # ownership records and staging markers: rewritten by flux-port, not the model's
GONE = "(missing)"


def file_digest(path: Path) -> bytes:
    """sha256 over the size and the sampled content of one file (whole when small)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        size = f.seek(0, 2)
        h.update(size.to_bytes(8, "little"))
        f.seek(0)
        if size <= 2 * SAMPLE:
            h.update(f.read())
        else:
            h.update(f.read(SAMPLE))
            f.seek(size - SAMPLE)
            h.update(f.read(SAMPLE))
    return h.digest()


def identity(path: Path) -> str:
    """A component folder's (or a lone file's) identity; GONE when it is not there."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(SKIPPED_PREFIX))
    else:
        return GONE
    h = hashlib.sha256()
    for f in files:
        rel = f.name if f == path else f.relative_to(path).as_posix()
        h.update(rel.encode() + b"\0" + file_digest(f))
    return h.hexdigest()


def source_components(folder: Path, layout: str, transformer: Path | None) -> dict[str, Path]:
    """What an export borrows from its source: every component folder `model_index.json` lists (and the index
    itself) for a pipeline; the transformer folder alone for a lone transformer."""
    folder = Path(folder)
    if layout != "pipeline":
        return {"transformer": Path(transformer or folder)}
    index = read_json_object(folder / "model_index.json", "the pipeline's model index")
    parts = {"model_index.json": folder / "model_index.json"}
    for name, value in sorted(index.items()):
        if not name.startswith("_") and isinstance(value, list) and value and value[0] is not None:
            parts[name] = folder / name
    return parts


def borrowed(parts: Mapping[str, Path]) -> dict[str, dict[str, str]]:
    """The manifest's `identities.source`: each borrowed component by absolute path and identity."""
    return {n: {"path": str(Path(p).resolve()), "identity": identity(p)} for n, p in parts.items()}


def exported(folders: Mapping[str, Path]) -> dict[str, dict[str, str]]:
    """The manifest's `identities.export`: each of the export's component folders (named relative to the export)
    by identity."""
    return {n: {"identity": identity(p)} for n, p in folders.items()}


def check(root: Path, manifest: Mapping[str, Any], *, own: bool = True) -> None:
    """Refuse (exit 2) an export whose own components or borrowed ones changed since it was made, naming the
    component and both identities. `own=False` checks the borrowed ones only: `port validate` judges the export's
    own graph by its numbers (an edited graph must come out FAIL, not be refused)."""
    recorded = manifest.get("identities")
    if not isinstance(recorded, dict) or not all(isinstance(recorded.get(k), dict) for k in ("source", "export")):
        raise InputError(f"{root}: the export records no component identities (made by an older flux-port, or the "
                         "manifest was edited), so nothing proves its source folder still holds the model it was "
                         "exported from.", hint="Export again: port export SOURCE --format onnx --out NEW_FOLDER.")
    sides = (("export", "the export's own"), ("source", "the source folder's")) if own else \
        (("source", "the source folder's"),)
    changed = []
    for side, where in sides:
        for name, entry in recorded[side].items():
            path = Path(entry.get("path") or "") if side == "source" else Path(root) / name
            now = identity(path) if side == "export" or entry.get("path") else GONE  # no path: nothing to find
            if now != entry.get("identity"):
                state = "is gone" if now == GONE else "changed"
                changed.append(f"{where} {name} ({path}) {state}: recorded identity "
                               f"{str(entry.get('identity'))[:16]}..., now {now[:16]}{'...' if now != GONE else ''}")
    if changed:
        raise InputError(f"{root}: {len(changed)} component(s) changed since the export; running it would mix two "
                         "models: " + "; ".join(changed),
                         hint="Export again from the current source folder, or put the exported-from model back.")
