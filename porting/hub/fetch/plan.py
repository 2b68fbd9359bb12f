"""From a listing to a plan: which files are selected, which are already verified, what is still missing."""

from __future__ import annotations

import difflib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from porting.errors import DiskSpaceError, InputError

from . import manifest
from .globs import select
from .sources import Source
from .verify import RemoteFile


@dataclass(frozen=True)
class Listing:
    """What the hub said: the requested revision, the commit it resolved to (None on ModelScope), the files."""

    revision: str
    commit: str | None
    files: list[RemoteFile]


@dataclass
class PlannedFile:
    remote: RemoteFile
    state: str      # "verified" (skip), "partial" (resume), "unchecked" (on disk, no record: hash it), "missing"
    have: int = 0   # bytes already on disk that count towards this file

    @property
    def missing_bytes(self) -> int:
        return 0 if self.state == "verified" else self.remote.size - self.have


@dataclass
class Plan:
    part: str                # "source", or the recipe part ("base", "finetune")
    source: Source
    out: Path
    listing: Listing
    selection: dict[str, list[str]]
    files: list[PlannedFile] = field(default_factory=list)
    token_sent: bool = False

    @property
    def total_bytes(self) -> int:
        return sum(f.remote.size for f in self.files)

    @property
    def missing_bytes(self) -> int:
        return sum(f.missing_bytes for f in self.files)

    def to_dict(self) -> dict[str, Any]:
        return {"part": self.part, "source": self.source.label, "hub": self.source.hub, "repo": self.source.repo,
                "endpoint": self.source.endpoint, "revision": self.listing.revision, "commit": self.listing.commit,
                "out": str(self.out), "selection": self.selection, "token_sent": self.token_sent,
                "total_bytes": self.total_bytes, "missing_bytes": self.missing_bytes,
                "files": [{"path": f.remote.path, "size": f.remote.size, "sha256": f.remote.sha256,
                           "git_sha1": f.remote.git_sha1, "state": f.state, "have": f.have} for f in self.files]}


def choose(listing: Listing, repo: str, include: list[str], exclude: list[str], files: list[str]) -> list[RemoteFile]:
    """Apply --file (exact paths) or --include / --exclude (globs.py) to the listing."""
    by_path = {f.path: f for f in listing.files}
    at = listing.commit or listing.revision
    if files:
        absent = [p for p in files if p not in by_path]
        if absent:
            close = difflib.get_close_matches(absent[0], list(by_path), n=3)
            raise InputError(f"{', '.join(absent)} {'is' if len(absent) == 1 else 'are'} not in {repo} at {at}.",
                             hint=(f"Did you mean {', '.join(close)}? " if close else "") +
                             "Run with --dry-run --include '**' to list the repository's files.")
        return [by_path[p] for p in dict.fromkeys(files)]
    chosen = set(select(by_path, include, exclude))
    if not chosen:
        raise InputError(f"No file of {repo} at {at} matches the --include / --exclude patterns "
                         f"({len(by_path)} files listed).",
                         hint="Patterns follow flux-port's glob dialect (docs/fetch.md): '*' stops at '/', "
                              "'**' crosses folders, 'folder/' selects a whole folder.")
    return [f for f in listing.files if f.path in chosen]


def local_state(remote: RemoteFile, out: Path, records: dict[str, dict[str, Any]],
                partial: Callable[[RemoteFile], Path]) -> PlannedFile:
    dest = out / remote.path
    if manifest.still_verified(records.get(remote.path), remote, dest):
        return PlannedFile(remote, "verified")
    if dest.is_file():
        # probably the right file (copied in, or a run killed before recording it): hash it instead of downloading
        same_size = dest.stat().st_size == remote.size
        return PlannedFile(remote, "unchecked", remote.size if same_size else 0)
    part = partial(remote)
    if part.is_file() and 0 < part.stat().st_size <= remote.size:
        return PlannedFile(remote, "partial", part.stat().st_size)
    return PlannedFile(remote, "missing")


def disk_free(path: Path) -> int:
    """Free bytes on the volume that holds `path` (or its nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _volume(path: Path) -> tuple[int, Path]:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return os.stat(p).st_dev, p


def check_disk_space(plans: list[Plan], free: Callable[[Path], int] | None = None) -> None:
    """Refuse (DiskSpaceError) when a volume has less free space than the plans still need to write there."""
    free = free or disk_free
    need: dict[int, tuple[int, Path]] = {}
    for plan in plans:
        dev, where = _volume(plan.out)
        have = need.get(dev, (0, where))[0]
        need[dev] = (have + plan.missing_bytes, where)
    for required, where in need.values():
        available = free(where)
        if required > available:
            raise DiskSpaceError(
                f"Not enough disk space in {where}: {human(required)} ({required:,} bytes) still to download, "
                f"{human(available)} ({available:,} bytes) free.",
                hint="Free some space, or fetch to a larger disk with --out DIR (or --workspace DIR for recipes), "
                     "or narrow the selection with --include / --exclude. Files already verified are not counted.")


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"
