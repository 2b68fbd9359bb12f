"""Check a downloaded file against what the hub lists: SHA-256 (LFS / ModelScope), git blob SHA-1, else size."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from porting.tensors.digests import BesideDigests, Range, safetensors_ranges

_BLOCK = 8 << 20


@dataclass(frozen=True)
class RemoteFile:
    """One file of a listing, with whatever the hub says about its content."""

    path: str
    size: int
    sha256: str | None = None    # LFS files on the Hub; every listed file on ModelScope
    git_sha1: str | None = None  # regular (non-LFS) files on the Hub: the git blob id

    @property
    def check(self) -> str:
        return "sha256" if self.sha256 else "git-sha1" if self.git_sha1 else "size"

    @property
    def key(self) -> str:
        """A content-derived name for the partial file, so a partial never mixes two contents."""
        return self.sha256 or self.git_sha1 or f"size-{self.size}-{self.path.replace('/', '--')}"


def file_digests(path: Path, git: bool, on_bytes: Callable[[int], None] | None = None,
                 tensors: dict[Range, str] | None = None) -> tuple[str, str | None]:
    """(sha256, git blob sha1 or None) of a file, read once. Given `tensors`, a safetensors file's per-tensor
    sha256 (by byte range) are put there too, from the same reads, on a second thread."""
    size = path.stat().st_size
    sha256 = hashlib.sha256()
    sha1 = hashlib.sha1(f"blob {size}\0".encode()) if git else None
    ranges = safetensors_ranges(path) if tensors is not None else None
    beside = BesideDigests(ranges) if ranges else None
    offset = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(_BLOCK):
                if beside is not None:
                    beside.feed(offset, block)
                offset += len(block)
                sha256.update(block)
                if sha1 is not None:
                    sha1.update(block)
                if on_bytes:
                    on_bytes(len(block))
        if beside is not None and tensors is not None:
            tensors.update(beside.done())
    finally:
        if beside is not None:
            beside.close()
    return sha256.hexdigest(), sha1.hexdigest() if sha1 else None


def mismatch(path: Path, remote: RemoteFile, on_bytes: Callable[[int], None] | None = None,
             tensors: dict[Range, str] | None = None) -> tuple[str | None, str | None]:
    """(problem or None, sha256 of the local file or None when only the size was checked); `tensors` as
    `file_digests` fills it for a .safetensors file."""
    size = path.stat().st_size
    if size != remote.size:
        return f"size {size:,} bytes, expected {remote.size:,}", None
    sha256, sha1 = file_digests(path, git=remote.sha256 is None and remote.git_sha1 is not None, on_bytes=on_bytes,
                                tensors=tensors if remote.path.lower().endswith(".safetensors") else None)
    if remote.sha256 and sha256 != remote.sha256.lower():
        return f"sha256 {sha256}, expected {remote.sha256}", sha256
    if not remote.sha256 and remote.git_sha1 and sha1 != remote.git_sha1.lower():
        return f"git blob sha1 {sha1}, expected {remote.git_sha1}", sha256
    return None, sha256
