"""What flux-port knows of a file it hashed or wrote, kept so that a later verb need not read it again, and
trusted only as a hint.

port fetch hashes a download while verifying it (the file's sha256 and each tensor's). Convert records the
per-tensor digests it has (those fetch took, or those it took of the tensors it split or computed) and the weights
identity of the set of shards it wrote; it does not hash the files it writes. The file's sha256 is taken by the
first verb that certifies it (publish for manifest.json, --push for the LFS oid), which records it for the others,
so a convert-only user never pays for it and the end-to-end path hashes each byte once.

Each record is sealed under this user's key in the state folder, keyed by the file's device and inode, and holds
the file's size, modification time and change time (ctime): what a hard link or a directory rename keeps and what
any rewrite changes. The change time is the kernel's, and no program can set it back: an edit in place that puts
the size and the modification time back (`touch -d`) still changes it, and the record no longer describes the file,
which is then read and hashed. A link or unlink flux-port itself makes (publish's hard links, a replaced published
folder) also changes it; `carry_over` moves the record across such a step of flux-port's own. A record is a hint:
push hands the file's recorded sha256 to the hub as its LFS oid, and when the hub rejects it, the file is hashed
again and the record dropped (`forget`), naming the true cause.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from porting.ownership import (
    SealingKeyError,
    read_state_record,
    same_file_facts,
    state_folder,
    write_state_record,
)

KIND = "digests"
FORMAT = 2  # 2: the change time is part of the facts, and a file's sha256 may be absent (convert records none)
Range = tuple[int, int]  # a tensor's bytes in its file: (offset, length)
_HEX64 = re.compile(r"[0-9a-f]{64}")
READ = 1 << 20  # bytes per read when a file must be hashed: small enough to stay in the CPU cache


def _stat(path: Path) -> os.stat_result | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st if stat.S_ISREG(st.st_mode) else None


def _facts(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _describes(doc: dict, st: os.stat_result) -> bool:
    facts = doc.get("file")
    return (doc.get("format_version") == FORMAT and same_file_facts(facts, st)
            and isinstance(facts, dict) and facts.get("ctime_ns") == st.st_ctime_ns)


def _record(st: os.stat_result) -> dict | None:
    """The record of `st`'s file while it still describes the file (device, inode, size, mtime and ctime)."""
    try:
        doc = read_state_record(KIND, st)
    except SealingKeyError:
        return None
    return doc if doc is not None and _describes(doc, st) else None


def known_sha256(path: Path) -> str | None:
    """The sha256 of `path` recorded when it was hashed, while the file is still as it was then."""
    st = _stat(path)
    doc = _record(st) if st is not None else None
    if doc is not None and isinstance(doc["file"].get("sha256"), str):
        return str(doc["file"]["sha256"])
    return None


def _write(st: os.stat_result, doc: dict[str, object]) -> None:
    try:
        write_state_record(KIND, st, doc)
        _prune_once()
    except (SealingKeyError, OSError):
        pass


def remember(path: Path, sha256: str | None = None, weights: Mapping[str, object] | None = None,
             expect: os.stat_result | None = None, tensors: Mapping[Range, str] | None = None) -> None:
    """Record what is known of `path` as it is now: its sha256, and for a shard the weights identity of its set, and
    each tensor's sha256 by byte range; what a record of the file as it is now already holds is kept unless given
    anew. `expect`: the file's stat when it was hashed or written; a file that changed since is not recorded.
    Without a usable sealing key nothing is recorded: later verbs hash it again."""
    st = os.stat(path)
    if expect is not None and _facts(expect) != _facts(st):
        return
    doc: dict[str, object] = _record(st) or {}
    facts: dict[str, object] = {"device": st.st_dev, "inode": st.st_ino, "size": st.st_size,
                                "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
    known = doc.get("file")
    if sha256 is not None or (isinstance(known, dict) and isinstance(known.get("sha256"), str)):
        facts["sha256"] = sha256 if sha256 is not None else known["sha256"]  # type: ignore[index]
    doc = {**{k: v for k, v in doc.items() if k != "seal"}, "format_version": FORMAT,
           "path": os.path.abspath(path), "file": facts}
    if weights is not None:
        doc["weights"] = dict(weights)
    if tensors:
        doc["tensors"] = {f"{start}:{length}": digest for (start, length), digest in sorted(tensors.items())}
    _write(st, doc)


def carry_over(before: os.stat_result, path: Path) -> None:
    """Keep the record of a file across a link or unlink flux-port itself just made (it changes the file's change
    time, nothing else): the record that described `before` now describes `path` as it is, when device, inode, size
    and modification time are still `before`'s. Call it right after that step: only that step may lie between."""
    doc = _record(before)
    try:
        st = os.stat(path)
    except OSError:
        return
    if doc is None or _facts(st)[:4] != _facts(before)[:4] or st.st_ctime_ns == before.st_ctime_ns:
        return
    file = {**doc["file"], "ctime_ns": st.st_ctime_ns}
    _write(st, {**{k: v for k, v in doc.items() if k != "seal"}, "file": file})


def forget(path: Path) -> None:
    """Drop what is recorded of `path` (its record was found to lie: a hub rejected its sha256)."""
    st = _stat(path)
    if st is None:
        return
    try:
        write_state_record(KIND, st, {"format_version": FORMAT, "path": os.path.abspath(path), "file": {}})
    except (SealingKeyError, OSError):
        pass



def known_tensor_digests(path: Path) -> dict[Range, str]:
    """Each tensor's sha256 by byte range, recorded when port fetch verified `path`, while the file is as it was
    then; else {}."""
    st = _stat(path)
    doc = _record(st) if st is not None else None
    digests = doc.get("tensors") if doc is not None else None
    if not isinstance(digests, dict):
        return {}
    known: dict[Range, str] = {}
    for key, digest in digests.items():
        start, _, length = str(key).partition(":")
        if not (start.isdigit() and length.isdigit() and isinstance(digest, str) and _HEX64.fullmatch(digest)):
            return {}
        known[(int(start), int(length))] = digest
    return known


def tensor_digests(files: Iterable[Path]) -> dict[Path, dict[Range, str]]:
    """`known_tensor_digests` of each file that has them: a tensor copied byte for byte reuses its digest instead
    of being read again."""
    known = {}
    for file in files:
        digests = known_tensor_digests(file)
        if digests:
            known[file] = digests
    return known


PRUNE_AT = 4096  # records kept before the stale ones are swept (a few hundred bytes each)
_pruned: set[Path] = set()


def _prune_once() -> None:
    """Once per process, when the records pass `PRUNE_AT`: remove those whose file is gone or changed (by the path
    it was recorded under, or a later rename's, which the inode still finds: such records stay). A record still
    used costs one stat; one removed here is only a digest taken again later."""
    folder = state_folder() / KIND
    if folder in _pruned:
        return
    _pruned.add(folder)
    entries = list(os.scandir(folder))
    if len(entries) <= PRUNE_AT:
        return
    for entry in entries:
        try:
            with open(entry.path, "rb") as f:
                doc = json.loads(f.read(1 << 16))
            st = os.stat(doc["path"])
            if _describes(doc, st):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            pass
        try:
            os.unlink(entry.path)
        except OSError:
            pass


def hash_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """sha256 of `path`, read front to back."""
    digest = hashlib.sha256()
    buf = memoryview(bytearray(READ))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(buf[:n])
            if on_bytes:
                on_bytes(n)
    return digest.hexdigest()


def file_sha256(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    """The sha256 of `path`: the recorded one while the file is unchanged, else hashed now (and recorded)."""
    known = known_sha256(path)
    if known is not None:
        if on_bytes:
            on_bytes(path.stat().st_size)
        return known
    before = os.stat(path)
    digest = hash_file(path, on_bytes)
    remember(path, digest, expect=before)  # not when the file changed while it was read
    return digest


def shards_record(weights_sha256: str, names: Sequence[str]) -> dict[str, object]:
    """What each shard of a set records of the set: its weights identity, every shard's name, and the one write
    that made them all (a random id: a shard of another write by the same name is not of this set)."""
    return {"sha256": weights_sha256, "files": sorted(names), "write": os.urandom(16).hex()}


def weights_of(files: Sequence[Path], compute: Callable[[], str]) -> str:
    """The weights identity of the tensors in `files`: recorded (`known_weights`), else `compute()`d and recorded
    for the set, as a convert that took it would have (not for a file that changed while it was computed)."""
    known = known_weights(files)
    if known is not None:
        return known
    before = {Path(f): _stat(f) for f in files}
    identity = compute()
    if len({Path(f).parent for f in files}) == 1 and all(before.values()):
        weights = shards_record(identity, [Path(f).name for f in files])
        for f, st in before.items():
            remember(f, weights=weights, expect=st)
    return identity


def known_weights(files: Sequence[Path]) -> str | None:
    """The weights identity of the tensors in `files`, when they are exactly a set of shards written together
    and each is unchanged since; None otherwise (the caller hashes the tensors)."""
    if not files or len({Path(f).parent for f in files}) != 1:
        return None
    sets = set()
    for f in files:
        st = _stat(f)
        doc = _record(st) if st is not None else None
        weights = doc.get("weights") if doc else None
        if not isinstance(weights, dict) or not isinstance(weights.get("files"), list):
            return None
        if set(weights["files"]) != {Path(g).name for g in files}:
            return None
        sets.add((str(weights.get("sha256")), str(weights.get("write"))))
    return sets.pop()[0] if len(sets) == 1 else None
