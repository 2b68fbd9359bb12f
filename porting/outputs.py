"""Output folders the tool can prove it wrote, and the rules for replacing them.

Every folder flux-port writes carries an ownership record (`porting/ownership.py`) listing the files it wrote,
sealed to that folder. A folder is replaced only when that record proves everything in it is flux-port's: a
user's notes, another model or the source itself are never deleted. Outputs are built in a staging folder next to
the destination, which holds an exclusive lock and a sealed marker while the run is alive; a later run removes (and
reports) the marked staging folders of dead runs, leaves alike-named folders of anyone else alone, and refuses to
write while another live run is writing the same destination.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import signal
import stat
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Collection, Iterator, Literal, Mapping, Sequence

from porting.errors import DiskSpaceError, OutputExistsError, PortError
from porting.ownership import (
    RECORD,
    STAGING_MARKER,
    foreign_entries,
    is_flux_port_staging,
    read_record,
    write_record,
    write_staging_marker,
)

__all__ = ["RECORD", "UnsafeOutputError", "atomic_folder", "check_output", "check_replaceable", "foreign_entries",
           "write_record", "timestamped_folder"]

Replace = Literal["never", "force", "owned"]
"""never: refuse an existing folder; force: replace it when --force was given and the tool owns it;
owned: replace it whenever the tool owns it (derived outputs such as validation reports)."""


class UnsafeOutputError(PortError):
    """The output would delete, replace or overlap files the tool did not write."""


def check_replaceable(out: Path, what: str = "output folder", owner_verbs: Collection[str] | None = None,
                      option: str = "--out") -> None:
    """Raise unless `out` is a real folder (not a link) whose every entry flux-port can prove it wrote there;
    with `owner_verbs`, also unless the folder was written by one of those verbs. `option` names the option the
    user gave the folder with (the hints name it)."""
    st = os.lstat(out)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeOutputError(f"{out}: the {what} is a symbolic link; flux-port replaces only folders it wrote.",
                                hint=f"Choose another {option}, or remove the link yourself.")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeOutputError(f"{out}: the {what} exists and is not a folder; flux-port will not replace it.",
                                hint=f"Choose another {option} (a new folder).")
    if not any(out.iterdir()):
        return
    foreign = foreign_entries(out)
    if foreign is None:
        raise UnsafeOutputError(
            f"{out}: the {what} exists and was not written by flux-port (no {RECORD} made for this folder by "
            "flux-port on this machine; a copied or downloaded one proves nothing); nothing was changed.",
            hint=f"Choose a new {option} folder, or empty or remove this one yourself if you are sure.")
    if foreign:
        shown = ", ".join(repr(f) for f in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UnsafeOutputError(
            f"{out}: the {what} holds files flux-port did not write ({shown}); nothing was changed.",
            hint=f"Move those files elsewhere or choose another {option}.")
    record = read_record(out)
    if owner_verbs is not None and record is not None and record.verb not in owner_verbs:
        raise UnsafeOutputError(
            f"{out}: the {what} is the output of `port {record.verb}`, not of `port {' / '.join(owner_verbs)}`; "
            "nothing was changed.", hint=f"Choose another {option}.")


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


InputPaths = Mapping[str, "Path | str | None | Sequence[Path | str]"]
"""What a verb reads, by label: one path, None (not given), or several paths under one label (adapters, images)."""


def _labelled(inputs: InputPaths) -> Iterator[tuple[str, Path | str]]:
    for label, value in inputs.items():
        for path in [value] if value is None or isinstance(value, (str, os.PathLike)) else value:
            if path is not None and str(path) != "":
                yield label, path


def check_disjoint(out: Path, inputs: InputPaths) -> None:
    """Refuse an output that is, contains or lies inside one of the inputs (compared after resolving links).

    Every path a verb reads counts: bases, transformers, adapters, reports, images, configs, manifests.
    """
    target = Path(os.path.realpath(out))
    for label, value in _labelled(inputs):
        source = Path(os.path.realpath(value))
        if target == source:
            relation = "is"
        elif _is_within(source, target):
            relation = "contains"
        elif _is_within(target, source) and source.is_dir():
            relation = "lies inside"
        else:
            continue
        raise UnsafeOutputError(f"{out}: the output {relation} the {label} {value}; flux-port never writes over "
                                "or around its inputs. Nothing was changed.",
                                hint="Choose an --out folder outside the inputs.")


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, tmpfs)
_RANDOM = 8  # the characters mkdtemp appends


def sibling_prefix(out: Path, kind: str) -> str:
    """`.NAME.KIND-` for the staging (partial) and trash (old) folders next to `out`; for a long NAME whose
    folder name would pass NAME_MAX bytes, `.SHORTENED~HASH.KIND-`: the name's head and a hash of the whole name,
    so it is still one name per destination (leftovers are found by this same prefix)."""
    name = out.name
    prefix = f".{name}.{kind}-"
    if len(os.fsencode(prefix)) + _RANDOM <= NAME_MAX:
        return prefix
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    tail = f"~{digest}.{kind}-"
    room = NAME_MAX - _RANDOM - len(tail) - 1 - 16  # and some margin
    head = name
    while len(os.fsencode(head)) > room:
        head = head[:-1]
    return f".{head}{tail}"


def _staging_prefix(out: Path) -> str:
    return sibling_prefix(out, "partial")


def _trash_prefix(out: Path) -> str:
    return sibling_prefix(out, "old")


def clear_leftovers(out: Path, own: Path | None = None) -> list[Path]:
    """Remove staging and trash folders of earlier runs writing `out` that are no longer alive; return them.

    Only folders carrying a sealed staging marker of this machine's flux-port count: anything else named alike
    is left alone.

    Raises when another live run (its staging folder still locked) is writing the same destination.
    """
    removed = []
    parent = out.parent
    if not parent.is_dir():
        return removed
    for entry in sorted(parent.iterdir()):
        name = entry.name
        if entry == own or not (name.startswith(_staging_prefix(out)) or name.startswith(_trash_prefix(out))):
            continue
        if entry.is_symlink() or not entry.is_dir() or not is_flux_port_staging(entry):
            continue  # a folder named alike that no flux-port run made is somebody else's
        fd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if not _lock(fd):
                raise UnsafeOutputError(f"{out}: another flux-port run is writing this output now ({entry.name}).",
                                        hint="Wait for it to finish, or choose another --out.")
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            os.close(fd)
    return removed


def umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def make_public(path: Path) -> None:
    """Give a folder made by mkdtemp (private) the permissions of an ordinary folder."""
    os.chmod(path, 0o777 & ~umask())


def check_writable_parent(out: Path, option: str = "--out") -> None:
    """Find an unwritable destination before any work: a parent that is a file, a dangling link, no permission."""
    if out.is_symlink() and not out.exists():
        raise UnsafeOutputError(f"{out}: the output is a dangling symbolic link.",
                                hint=f"Remove the link or choose another {option}.")
    parent = out.parent
    probe = parent
    while not probe.exists():
        if probe.is_symlink():
            raise UnsafeOutputError(f"{out}: {probe} is a dangling symbolic link.", hint=f"Choose another {option}.")
        probe = probe.parent
    if not probe.is_dir():
        raise UnsafeOutputError(f"{out}: cannot create it, {probe} is a file, not a folder.",
                                hint=f"Choose another {option}.")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UnsafeOutputError(f"{out}: cannot write there, {probe} is not writable.",
                                hint=f"Choose a writable {option} folder.")


def _short_write_on_full_disk(e: OSError, folder: Path) -> bool:
    """A write that a library reported as short, with no errno (numpy's tofile: "1024 requested and 720 written"),
    on a disk with no room left: the disk is full."""
    if e.errno is not None or "requested and" not in str(e):
        return False
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 2**20


def write_error(out: Path, e: OSError, full: bool = False) -> Exception:
    """A write that the disk refused, as the error the docs promise (full disk: exit 5); other errors as they are.
    `full`: the disk was found full when the write failed (a short write without an errno)."""
    if full or e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskSpaceError(f"{out}: the disk is full ({e.strerror}); the partial output was removed, nothing "
                              "at the destination changed.",
                              hint="Free some space, or choose an --out on another disk.")
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return UnsafeOutputError(f"{out}: cannot write there ({e.strerror}); nothing at the destination changed.",
                                 hint="Choose a writable --out folder.")
    return e


def check_output(out: Path, force: bool = False, *, verb: str = "convert", replace: Replace | None = None,
                 inputs: Mapping[str, Path | str | None] | None = None) -> None:
    """The checks `atomic_folder` makes before writing, for verbs that want to fail before their long work."""
    out = Path(os.path.abspath(out))  # `--out .` has no name to put a staging folder next to
    check_writable_parent(out)
    if inputs:
        check_disjoint(out, inputs)
    _check_existing(out, replace or ("force" if force else "never"), verb)


def _check_existing(out: Path, replace: Replace, verb: str) -> None:
    if not (out.exists() or out.is_symlink()):
        return
    if replace == "never":
        raise OutputExistsError(f"{out}: output folder already exists.",
                                hint="Pass --force to replace it (only a folder flux-port wrote), "
                                     "or choose another --out.")
    check_replaceable(out, owner_verbs={verb} if replace == "owned" else None)


@contextmanager
def atomic_folder(out: Path, force: bool = False, *, verb: str = "convert", replace: Replace | None = None,
                  inputs: Mapping[str, Path | str | None] | None = None,
                  on_notice: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Yield a staging folder next to `out`; move it into place only if the block finishes without error.

    An existing `out` is replaced only as `replace` allows (default: "force" when `force`, else "never") and only
    when flux-port owns it. The staging folder holds a lock for the run's lifetime; leftovers of dead runs are
    removed and reported through `on_notice`.
    """
    out = Path(os.path.abspath(out))
    replace = replace or ("force" if force else "never")
    try:  # a refusal, a failure or an interruption takes back the folders made to hold `out` (when empty)
        check_output(out, verb=verb, replace=replace, inputs=inputs)
        for folder in reversed([p for p in out.parents if not (p.exists() or p.is_symlink())]):
            folder.mkdir(exist_ok=True)
            note_made(folder)
        with _staged(out, verb, replace, on_notice) as staging:
            yield staging
    except BaseException:
        discard_made(out)
        raise
    _made.difference_update(out.parents)


_made: set[Path] = set()
"""Folders this process made to hold an output (`--out a/b/c` makes a/ and a/b/; a report run makes reports/ and
reports/<verb>/): removed again, when empty, if the run fails."""


def note_made(folder: Path) -> None:
    _made.add(Path(os.path.abspath(folder)))


def discard_made(out: Path) -> None:
    """After a failed run writing `out`: remove the folders above it that this process made and that hold nothing
    now (a folder holding only the ownership record flux-port wrote there counts as empty), deepest first."""
    for folder in Path(os.path.abspath(out)).parents:
        if folder not in _made:
            continue
        _made.discard(folder)
        try:
            entries = [e.name for e in folder.iterdir()]
            if entries == [RECORD] and read_record(folder) is not None:
                (folder / RECORD).unlink()
            folder.rmdir()
        except OSError:
            return  # not empty (or not ours to judge): leave it and everything above it


@contextmanager
def _staged(out: Path, verb: str, replace: Replace, on_notice: Callable[[str], None] | None) -> Iterator[Path]:
    staging: Path | None = None
    lock_fd = -1
    try:
        try:  # from the first moment on: an interruption (Ctrl-C, SIGTERM) while the folder is set up removes it too
            with _signals_held():  # a signal waits until `staging` names the folder the handlers below remove
                staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(out), dir=out.parent))
            lock_fd = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
            _lock(lock_fd)
            write_staging_marker(staging)
            for old in clear_leftovers(out, own=staging):
                if on_notice:
                    on_notice(f"removed {old.name}, left in {old.parent} by an earlier interrupted run")
            make_public(staging)
            yield staging
            (staging / STAGING_MARKER).unlink()
            write_record(staging, verb)
            _check_existing(out, replace, verb)  # it may have appeared, or changed, while this run was writing
        except OSError as e:
            if staging is None:
                raise
            full = _short_write_on_full_disk(e, staging)
            shutil.rmtree(staging, ignore_errors=True)
            raise write_error(out, e, full) from e
        except BaseException:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        if out.exists() or out.is_symlink():
            trash = Path(tempfile.mkdtemp(prefix=_trash_prefix(out), dir=out.parent))
            write_staging_marker(trash)
            with _signals_held():  # Ctrl-C / SIGTERM between the two renames would leave no output at all
                os.replace(out, trash / "old")
                os.replace(staging, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(staging, out)
    finally:
        if lock_fd >= 0:
            os.close(lock_fd)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM (delivered when the block ends) for a few operations that must not be split."""
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    except (AttributeError, OSError, ValueError):
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def timestamped_folder(root: Path) -> Path:
    """A new `root/<UTC time>` folder name (suffixed -2, -3, ... when taken), for reports kept side by side."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out, n = root / stamp, 1
    while out.exists():
        n += 1
        out = root / f"{stamp}-{n}"
    return out
