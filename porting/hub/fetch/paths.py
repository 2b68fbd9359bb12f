"""Refuse a listing that could write outside the output folder, before anything is written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from porting.errors import CheckFailed

MANIFEST_NAME = "fetch-manifest.json"
PARTIAL_DIR = ".fetch-partial"   # resumable partial files, inside the output folder (same volume: atomic rename)
RESERVED = {MANIFEST_NAME, PARTIAL_DIR}


def _escape(name: str) -> str:
    """Show a remote name without letting control characters reach the terminal."""
    return name.encode("unicode_escape").decode("ascii")


def unsafe_reason(path: str) -> str | None:
    """Why a repository path must not be written to disk, or None when it is a plain relative path."""
    if not path:
        return "empty path"
    if any(ord(c) < 32 or c == "\x7f" for c in path):
        return "control character in the name"
    if "\\" in path:
        return "backslash in the name"
    if path.startswith("/") or (len(path) > 1 and path[1] == ":"):
        return "absolute path"
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "'..', '.' or an empty segment"
    if parts[0] in RESERVED:
        return f"collides with flux-port's own {parts[0]}"
    return None


def check_listing(paths: Iterable[str], out_dir: Path, repo: str) -> None:
    """Raise CheckFailed naming every unsafe path: traversal, absolute, file/folder clash, symlink escape.

    The symlink check resolves each destination against what already exists in `out_dir`, so a link left
    in the output folder (for example `sub -> /etc`) cannot redirect a write outside it.
    """
    paths = list(paths)
    problems = [f"{_escape(p)!r}: {r}" for p in paths if (r := unsafe_reason(p))]
    if not problems:
        files = set(paths)
        folders = {"/".join(p.split("/")[:i]) for p in paths for i in range(1, p.count("/") + 1)}
        problems += [f"{_escape(p)!r}: listed both as a file and as a folder" for p in sorted(files & folders)]
    if not problems:
        root = Path(os.path.realpath(out_dir))
        for p in paths:
            dest = Path(os.path.realpath(out_dir / p))
            if not dest.is_relative_to(root):
                problems.append(f"{_escape(p)!r}: resolves to {dest}, outside {root} (symlink in the output folder)")
    if problems:
        shown = "\n".join(f"  {line}" for line in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckFailed(f"The listing of {repo} names {len(problems)} path(s) that would be written outside the "
                          f"output folder or are not plain relative paths; nothing was downloaded.",
                          details=shown + more,
                          hint="Do not use this source: a hub or mirror should never list such paths. If the "
                               "output folder holds a symlink, remove it or choose another --out.")
