"""Names and links read from the inputs: which may become a path, and which links may be followed.

Two rules keep every verb inside the folders it was given (docs/outputs.md):

- A file or folder name read from an input (a component of `model_index.json`, a shard of an index, the file an
  adapter manifest names) is a plain name: not empty, not `.` or `..`, no `/` or `\\`, not absolute, no control
  character. Anything else stops the run (exit 2) naming the file that holds it.
- A symbolic link in what is published or copied is followed only when its resolved target lies inside the input
  root it was found in. The one exemption is a Hugging Face cache snapshot (`models--ORG--NAME/snapshots/REV/`):
  its links may point into that same repository's `blobs/`, and nowhere else in the cache.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from porting.errors import InputError


class UnsafeInputError(InputError):
    """A name or link read from an input would reach outside that input."""


def plain_name_problem(name: object) -> str | None:
    """Why `name` cannot be used as one file or folder name, or None when it can."""
    if not isinstance(name, str):
        return f"not a string ({type(name).__name__})"
    if not name:
        return "empty"
    if name in (".", ".."):
        return "'.' or '..'"
    if "/" in name or "\\" in name:
        return "holds a path separator"
    if any(ord(c) < 32 or c == "\x7f" for c in name):
        return "holds a control character"
    if os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    return None


def check_plain_name(name: object, source: Path | str, what: str) -> str:
    """`name` when it is a plain file or folder name; otherwise UnsafeInputError naming `source` and the name."""
    problem = plain_name_problem(name)
    if problem is not None:
        shown = name.encode("unicode_escape").decode("ascii") if isinstance(name, str) else name
        raise UnsafeInputError(f"{source}: {what} {shown!r} is not a plain name ({problem}); flux-port never reads "
                               "or writes outside the folders it is given. Nothing was written.",
                               hint=f"Fix {Path(source).name}: each {what} must be one file or folder name "
                                    "inside that folder, without '..', '/' or '\\', not absolute.")
    return name


def check_component_names(index: Mapping[str, Any], path: Path | str) -> None:
    """Every component of a `model_index.json` (a key naming a [library, class] pair) is a plain folder name."""
    for key, value in index.items():
        if not key.startswith("_") and isinstance(value, (list, tuple)):
            check_plain_name(key, path, "component")


def _hub_blobs(folder: Path) -> Path | None:
    """The `blobs/` of the Hugging Face cache repository whose snapshot holds `folder` (resolved), if any."""
    for snapshot in (folder, *folder.parents):
        snapshots, repo = snapshot.parent, snapshot.parent.parent
        if snapshots.name == "snapshots" and repo.name.startswith("models--") and (repo / "blobs").is_dir():
            return repo / "blobs"
    return None


def link_roots(folder: Path | str) -> list[Path]:
    """Where links found in the input `folder` may point: the folder itself (resolved) and, for a Hugging Face
    cache snapshot (or a folder inside one), that repository's own `blobs/`."""
    resolved = Path(os.path.realpath(folder))
    blobs = _hub_blobs(resolved)
    return [resolved] + ([blobs] if blobs is not None else [])


def _inside(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def check_within(path: Path, roots: Sequence[Path], what: str = "file") -> Path:
    """The resolved `path`, after refusing it when a link takes it outside `roots` (or it does not exist)."""
    target = Path(os.path.realpath(path))
    if not _inside(target, roots):
        how = "a symbolic link" if os.path.islink(path) else f"a {what} under a symbolic link; it resolves"
        raise UnsafeInputError(f"{path}: {how} to {target}, outside {roots[0]}; flux-port never publishes or "
                               "copies files from outside the folders it is given. Nothing was written.",
                               hint="Replace the link by the file itself, or remove it.")
    if not target.exists():
        raise UnsafeInputError(f"{path}: a dangling symbolic link.", hint="Remove it or restore its target.")
    return target


def files_within(folder: Path, roots: Sequence[Path] | None = None) -> list[Path]:
    """The visible files under `folder`; every one (links resolved) must lie inside `roots`
    (default: `link_roots(folder)`). A link to a folder is refused: only files are published."""
    roots = list(roots) if roots is not None else link_roots(folder)
    check_within(folder, roots, "folder")
    files = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in [d for d in dirnames if (here / d).is_symlink()] + sorted(filenames):
            path = here / name
            if name.startswith("."):
                continue
            target = check_within(path, roots)
            if target.is_dir():
                raise UnsafeInputError(f"{path}: a symbolic link to a folder; flux-port publishes files only.",
                                       hint="Replace the link by the folder's files.")
            if path.is_file():
                files.append(path)
    return sorted(files)
