"""Proof that flux-port wrote a folder, file by file, or a single file.

An output folder carries `.flux-port-output.json`: the files, links and folders the run wrote (files with their
sizes), the folder's device and inode, the run's id, and a seal (HMAC-SHA256 under a key that never leaves this
machine's user state folder) over all of it. A record is proof only where its seal verifies and the folder it
sits in is the folder it was written for: one that arrived by download or copy (a repository that ships one, a
`cp -r` of an output) names another inode or carries a seal made under another key, and proves nothing.

Staging and trash folders carry a marker of the same kind (`.flux-port-staging.json`), so that only folders a
flux-port run made are ever cleared as leftovers.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from porting._files import parse_json
from porting.errors import InputError, UsageError

RECORD = ".flux-port-output.json"
STAGING_MARKER = ".flux-port-staging.json"
RECORD_VERSION = 2
_KEY_NAME = "ownership.key"

RUN_ID = uuid.uuid4().hex
"""This process's run; every record and marker it writes names it."""


def _state_dirs() -> Iterator[Path]:
    explicit = os.environ.get("FLUX_PORT_STATE_DIR")
    if explicit:
        yield Path(explicit)
        return
    yield Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "flux-port"
    yield Path(tempfile.gettempdir()) / f"flux-port-{os.getuid()}"


class SealingKeyError(UsageError):
    """The per-user sealing key is not what the docs promise, or there is no place to keep one (exit 2)."""


def state_folder() -> Path:
    """The folder holding this user's sealing key: the first candidate that holds one, else the first candidate
    (where the next run makes it)."""
    candidates = list(_state_dirs())
    return next((d for d in candidates if os.path.lexists(d / _KEY_NAME)), candidates[0])


_REMAKE = ("Remove it (rm {path}) and run again: flux-port makes a new key of 32 random bytes that only you can "
           "read. Outputs sealed with the old key are then no longer proven flux-port's (--force refuses them).")


def _read_key(path: Path) -> bytes | None:
    """The key at `path`; None when there is no file there. A key that is not a plain file of this user's, of 32
    bytes, that nobody else can read or write, is refused: never replaced by a throwaway one in silence."""
    def refuse(why: str) -> SealingKeyError:
        return SealingKeyError(f"{path}: the sealing key of flux-port's output records {why}; nothing was done.",
                               hint=_REMAKE.format(path=path))

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if os.path.islink(path):
            raise refuse("is a symbolic link") from e
        raise refuse(f"cannot be read ({e.strerror})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse("is not a plain file")
        if st.st_uid != os.getuid():
            raise refuse(f"belongs to another user (uid {st.st_uid})")
        if st.st_mode & 0o077:
            raise refuse(f"can be read or written by others (mode {stat.S_IMODE(st.st_mode):o}, must be 600), "
                         "so anyone who read it can forge records")
        key = os.read(fd, 33)
    finally:
        os.close(fd)
    if len(key) != 32:
        raise refuse(f"holds {len(key) if len(key) < 33 else 'more than 32'} bytes, not 32 random bytes")
    return key


def _create_key(folder: Path) -> bytes | str:
    """A new key in `folder` (made private), or why none can be kept there."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return f"{folder} is not a folder of yours"
        path = folder / _KEY_NAME
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        key = secrets.token_bytes(32)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        return key
    except FileExistsError:  # another process made it between the read and the create
        return _read_key(folder / _KEY_NAME) or f"{folder / _KEY_NAME} appeared empty"
    except OSError as e:
        return f"{folder}: {e.strerror}"


_key_cache: dict[str, tuple[Path, bytes]] = {}


def _keyed_folder() -> tuple[Path, bytes]:
    """(state folder, this user's sealing key), the key made on first use in the first folder that can hold one."""
    cache_id = os.environ.get("FLUX_PORT_STATE_DIR", "")
    if cache_id not in _key_cache:
        reasons = []
        for folder in _state_dirs():
            key = _read_key(folder / _KEY_NAME)
            made = key if key is not None else _create_key(folder)
            if isinstance(made, bytes):
                _key_cache[cache_id] = (folder, made)
                break
            reasons.append(made)
        else:
            raise SealingKeyError("flux-port has no place to keep the key that seals its output records ("
                                  + "; ".join(reasons) + "); nothing was done.",
                                  hint="Set FLUX_PORT_STATE_DIR to a folder of yours that is writable.")
    return _key_cache[cache_id]


def _key() -> bytes:
    return _keyed_folder()[1]


def require_key() -> None:
    """Fail now (exit 2) when no valid sealing key can be had, before a verb starts its work."""
    _key()


def _seal(doc: dict) -> str:
    body = json.dumps({k: v for k, v in doc.items() if k != "seal"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(_key(), body.encode(), hashlib.sha256).hexdigest()


def _identity(folder: Path) -> dict[str, int]:
    st = os.lstat(folder)
    return {"device": st.st_dev, "inode": st.st_ino}


def _sealed_doc(folder: Path, doc: dict) -> str:
    doc = {**doc, "tool": "flux-port", "run": RUN_ID, "folder": _identity(folder)}
    doc["seal"] = _seal(doc)
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _sealed_record(path: Path) -> dict | None:
    """The JSON document at `path` (a plain file) when its seal verifies under this user's key, else None."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        doc = parse_json(path.read_bytes(), str(path))
    except (OSError, InputError):
        return None
    if not isinstance(doc, dict) or doc.get("tool") != "flux-port" or not isinstance(doc.get("seal"), str):
        return None
    return doc if hmac.compare_digest(doc["seal"], _seal(doc)) else None


def _verified(folder: Path, name: str) -> dict | None:
    """The record or marker `name` in `folder`, when it was sealed on this machine for this very folder."""
    doc = _sealed_record(folder / name)
    if doc is None:
        return None
    try:
        return doc if doc.get("folder") == _identity(folder) else None
    except OSError:
        return None


# --- what a folder holds -------------------------------------------------------------------------------------------

def _entry(path: Path) -> object:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return {"link": os.readlink(path)}
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    return st.st_size


def _walk(folder: Path) -> Iterator[Path]:
    """Every entry under `folder`, links not followed, in a stable order."""
    for root, dirs, files in os.walk(folder, followlinks=False):
        dirs.sort()
        for name in sorted(dirs + files):
            yield Path(root) / name


def inventory(folder: Path, entries: Iterable[str] | None = None) -> dict[str, object]:
    """Relative path -> size (files), {"link": target} (links) or "dir" for everything under `folder` (or under
    the named top-level `entries`), the record itself left out."""
    tops = [folder / e for e in entries] if entries is not None else [folder]
    found: dict[str, object] = {}
    for top in tops:
        if not (top.exists() or top.is_symlink()):
            continue
        paths = [top] if top != folder else []
        if top.is_dir() and not top.is_symlink():
            paths += list(_walk(top))
        for p in paths:
            rel = p.relative_to(folder).as_posix()
            if rel != RECORD:
                found[rel] = _entry(p)
    return found


@dataclass
class Record:
    verb: str
    files: dict[str, object] = field(default_factory=dict)


def write_record(folder: Path, verb: str, entries: Iterable[str] | None = None) -> None:
    """Record what is in `folder` now (or under its top-level `entries`) as written by this flux-port run."""
    doc = {"format_version": RECORD_VERSION, "verb": verb, "files": inventory(folder, entries)}
    (folder / RECORD).write_text(_sealed_doc(folder, doc))


def extend_record(folder: Path, verb: str, entries: Iterable[str]) -> None:
    """Add the named top-level entries (as they are now) to the record of `folder`, keeping what it lists."""
    record = read_record(folder)
    files = dict(record.files) if record else {}
    files.update(inventory(folder, entries))
    doc = {"format_version": RECORD_VERSION, "verb": verb, "files": files}
    (folder / RECORD).write_text(_sealed_doc(folder, doc))


def add_folders(folder: Path, verb: str, names: Iterable[str]) -> None:
    """Add the named top-level folders (as folders, not their contents: each run folder in them carries its own
    record) to the record of `folder`, keeping what it lists and the verb that wrote it (`verb` for a new record)."""
    record = read_record(folder)
    files = dict(record.files) if record else {}
    files.update({name: "dir" for name in names})
    doc = {"format_version": RECORD_VERSION, "verb": record.verb if record else verb, "files": files}
    (folder / RECORD).write_text(_sealed_doc(folder, doc))


def read_record(folder: Path) -> Record | None:
    """The ownership record of `folder`, or None where there is none that proves anything."""
    doc = _verified(folder, RECORD)
    if doc is None or not isinstance(doc.get("files"), dict) or not isinstance(doc.get("verb"), str):
        return None
    return Record(verb=doc["verb"], files=doc["files"])


def write_staging_marker(folder: Path) -> None:
    (folder / STAGING_MARKER).write_text(_sealed_doc(folder, {"format_version": RECORD_VERSION, "kind": "staging"}))


def is_flux_port_staging(folder: Path) -> bool:
    """A staging or trash folder a flux-port run made here (not one a user named alike)."""
    return _verified(folder, STAGING_MARKER) is not None


# --- what in a folder is not flux-port's ---------------------------------------------------------------------------

def foreign_entries(folder: Path) -> list[str] | None:
    """Entries under `folder` that flux-port cannot prove it wrote; None when the folder has no valid record.

    A file is flux-port's when the record lists it at its current size; a link when the record lists the same
    target; a subfolder when the record lists it, or it carries a valid record of its own (a report written inside
    an output), or it holds only what is flux-port's. A staging folder of a run goes with its marker.
    """
    record = read_record(folder)
    if record is None:
        return None
    return _foreign(folder, folder, record.files)


def _foreign(root: Path, folder: Path, owned: dict[str, object]) -> list[str]:
    foreign: list[str] = []
    for entry in sorted(folder.iterdir()):
        rel = entry.relative_to(root).as_posix()
        if entry.parent == root and entry.name == RECORD:
            continue
        foreign += _foreign_entry(root, entry, rel, owned)
    return foreign


def _foreign_entry(root: Path, entry: Path, rel: str, owned: dict[str, object]) -> list[str]:
    st = os.lstat(entry)
    if not stat.S_ISDIR(st.st_mode):
        return [] if owned.get(rel) == _entry(entry) else [rel]
    nested = read_record(entry)
    if nested is not None:
        return [f"{rel}/{f}" for f in _foreign(entry, entry, nested.files)]
    if is_flux_port_staging(entry):
        return []
    inside = _foreign(root, entry, owned)
    if inside:
        return inside
    return [] if owned.get(rel) == "dir" or any(entry.iterdir()) else [rel]


# --- single files ----------------------------------------------------------------------------------------------------
# A file a verb writes on its own (`port generate --output X.png`) has no folder to hold a record, so its record is
# kept in the state folder, beside the key, named by the file's device and inode: `files/DEVICE-INODE.json`, sealed
# like a folder's, over the file's size, modification time and sha256. A text chunk or a name inside the file proves
# nothing (anyone can write one); a copy has another inode, an edit another size, time or hash.

_FILES = "files"


def _file_facts(path: Path, st: os.stat_result, sha256: str | None = None) -> dict[str, object]:
    if sha256 is None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        sha256 = digest.hexdigest()
    return {"device": st.st_dev, "inode": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sha256": sha256}


def _file_record_path(st: os.stat_result) -> Path:
    return _keyed_folder()[0] / _FILES / f"{st.st_dev}-{st.st_ino}.json"


def write_file_record(path: Path, verb: str, destination: Path | None = None, sha256: str | None = None) -> None:
    """Record the plain file `path`, as it is now, as written by this flux-port run; `destination`: the name it
    is about to be renamed to (a rename keeps the inode and the modification time); `sha256`: its hash when the
    caller has just verified it (else it is read once more)."""
    st = os.lstat(path)
    doc = {"format_version": RECORD_VERSION, "tool": "flux-port", "verb": verb, "run": RUN_ID,
           "path": os.path.abspath(destination or path), "file": _file_facts(path, st, sha256)}
    write_state_record(_FILES, st, doc)


def write_state_record(kind: str, st: os.stat_result, doc: dict) -> None:
    """Seal `doc` and keep it in the state folder under `kind`, keyed by the device and inode of `st`'s file."""
    doc = {**doc, "tool": "flux-port"}
    doc["seal"] = _seal(doc)
    record = _keyed_folder()[0] / kind / f"{st.st_dev}-{st.st_ino}.json"
    record.parent.mkdir(mode=0o700, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=".record-", dir=record.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(name, record)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def read_state_record(kind: str, st: os.stat_result) -> dict | None:
    """The sealed record kept under `kind` for `st`'s file (device and inode), when its seal verifies."""
    return _sealed_record(_keyed_folder()[0] / kind / f"{st.st_dev}-{st.st_ino}.json")


def same_file_facts(facts: object, st: os.stat_result) -> bool:
    """Whether a record's `file` facts still describe `st`: same device, inode, size and modification time."""
    return isinstance(facts, dict) and all(facts.get(k) == v for k, v in (
        ("device", st.st_dev), ("inode", st.st_ino), ("size", st.st_size), ("mtime_ns", st.st_mtime_ns)))


def file_is_flux_ports(path: Path) -> bool:
    """Whether the plain file `path` is, byte for byte and inode for inode, one this machine's flux-port wrote."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    doc = _sealed_record(_file_record_path(st)) if stat.S_ISREG(st.st_mode) else None
    if doc is None:
        return False
    try:
        return doc.get("file") == _file_facts(path, st)
    except OSError:
        return False
