"""`port publish`'s folder: the files placed (hard-linked, symlinked or copied), model_index.json and manifest.json."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Literal

from porting import __version__
from porting.adapters.publishing import adapter_sources
from porting.errors import DiskSpaceError
from porting.known_digests import carry_over, file_sha256, known_sha256, remember
from porting.paths import files_within, link_roots

from .publish_inputs import base_components, refuse_pickles, variant_spec

LinkMode = Literal["hardlink", "symlink", "copy"]
LINK_MODES: tuple[str, ...] = ("hardlink", "symlink", "copy")
MANIFEST = "manifest.json"


def link_file(src: Path, dst: Path, mode: str, hardlink: Callable[[Path, Path], None] = os.link) -> str:
    """Place `src` at `dst` by `mode`; returns how it was placed. A hard link that the filesystem refuses
    (another device, no link support, too many links) falls back to a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if mode == "hardlink":
        try:
            hardlink(src, dst)
            return "hardlink"
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP,
                               errno.EACCES):
                raise
    elif mode == "symlink":
        os.symlink(os.path.abspath(src), dst)
        return "symlink"
    shutil.copy2(src, dst)
    return "copy"


def build_model_index(base_index: dict[str, Any], variant: str) -> dict[str, Any]:
    import diffusers

    family, spec = variant_spec(variant)
    index: dict[str, Any] = {"_class_name": spec.pipeline, "_diffusers_version": diffusers.__version__}
    if spec.registers_is_distilled and "is_distilled" in base_index:
        index["is_distilled"] = bool(base_index["is_distilled"])
    for name in base_components(base_index):
        index[name] = list(base_index[name])
    for name, entry in base_index.items():  # optional components the base leaves empty (FluxPipeline's image encoder)
        if not name.startswith("_") and entry == [None, None]:
            index[name] = [None, None]
    index["transformer"] = ["diffusers", family.diffusers_class]
    return dict(sorted(index.items(), key=lambda kv: (not kv[0].startswith("_"), kv[0])))


def gather_sources(base: Path, base_index: dict[str, Any], transformer: Path,
                   carried: Any) -> list[tuple[Path, Path]]:
    """(file, path in the published folder) of the base's components, the transformer and the carried adapters;
    a base holding pickle weights is refused."""
    sources: list[tuple[Path, Path]] = [(f, Path(name) / f.relative_to(base / name))
                                        for name in base_components(base_index)
                                        for f in files_within(base / name, link_roots(base))]
    refuse_pickles([src for src, _ in sources])
    sources += [(f, Path("transformer") / f.relative_to(transformer)) for f in files_within(transformer)]
    return sources + adapter_sources(carried)


def check_space(out: Path, sources: list[tuple[Path, Path]], link: str) -> int:
    """The bytes of `sources`; a copy that would not fit next to `out` is refused."""
    total = sum(src.stat().st_size for src, _ in sources)
    if link == "copy":
        free = shutil.disk_usage(out.resolve().parent if out.parent.exists() else Path.cwd()).free
        if free < total:
            raise DiskSpaceError(f"{out.parent}: copying needs {total / 1e9:.2f} GB, {free / 1e9:.2f} GB free.",
                                 hint="Use --link hardlink or symlink, or free some space.")
    return total


def place_files(staging: Path, sources: list[tuple[Path, Path]], link: str,
                hardlink: Callable[[Path, Path], None] = os.link,
                on_bytes: Callable[[int], None] | None = None) -> dict[str, dict[str, Any]]:
    """Place every source under `staging`; returns {path in the folder: {"how": how it was placed}}. A copy of a
    file flux-port hashed before, unchanged since, keeps its known digest; a hard link keeps the file's record
    across the change of its change time that the link itself makes (known_digests.carry_over)."""
    files: dict[str, dict[str, Any]] = {}
    for src, rel in sources:
        before = os.stat(src)
        known = known_sha256(src)
        how = link_file(src, staging / rel, link, hardlink)
        if how == "hardlink":
            carry_over(before, staging / rel)
        elif how == "copy" and known is not None and known_sha256(src) == known:  # the same bytes, unchanged
            remember(staging / rel, known)
        files[rel.as_posix()] = {"how": how}
        if on_bytes:
            on_bytes(src.stat().st_size)
    return files


def write_manifest(staging: Path, files: dict[str, dict[str, Any]], placed: set[str], fields: dict[str, Any],
                   on_bytes: Callable[[int], None] | None = None) -> None:
    """Hash every file of the folder into `files` (the placed ones report their bytes) and write manifest.json:
    `fields` (what was published, from what), then the files."""
    for rel, info in files.items():
        info["bytes"] = (staging / rel).stat().st_size
        info["sha256"] = file_sha256(staging / rel, on_bytes if rel in placed else None)
    manifest = {"tool": "flux-port", "version": __version__, "format_version": 1, **fields,
                "files": dict(sorted(files.items()))}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
