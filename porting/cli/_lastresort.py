"""The last resort of the `port` entry point: an exception no verb turned into a PortError still ends in one clear
message and a documented exit code, never a traceback.

An allocation that failed (MemoryError, torch's "DefaultCPUAllocator: not enough memory", a device's "out of
memory") is exit 2 with the last memory estimate the run made (porting.resources.out_of_memory): a run that does not
fit is the user's to resize, whatever the allocator says. Input parsing that escaped the readers' own checks
(RecursionError, MemoryError, ValueError and their kin: a file deeper, larger or stranger than any check foresaw) is
exit 2 naming the input being read; a full disk reported by a library in its own words (safetensors' "No space left
on device (os error 28)") is exit 5; anything else is a flux-port bug, exit 70 (InternalError), with the exception
named. FLUX_PORT_DEBUG=1 still shows the traceback.
"""

from __future__ import annotations

import struct
from pathlib import Path
from types import TracebackType
from typing import Sequence

from porting.errors import DiskSpaceError, InputError, InternalError, PortError

# what input parsing raises when a file is nested, sized or encoded past what a reader expected
INPUT_ERRORS = (RecursionError, MemoryError, ValueError, OverflowError, struct.error)
# locals that name the file a reader was reading, innermost frame first
PATH_LOCALS = ("path", "file", "filename", "index_path", "manifest_path", "src", "source", "folder", "base")
OUT_LOCALS = ("out", "output", "workdir", "save_directory", "staging")  # where a full disk was being written
DISK_FULL = ("No space left on device", "os error 28", "Disk quota exceeded")


def _paths_in(tb: TracebackType | None, names: Sequence[str] = PATH_LOCALS, exist: bool = True) -> list[str]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    from porting.inputs import Source

    found: list[str] = []
    for frame in reversed(frames):  # innermost first: the reader (or writer) closest to the failure
        for name in names:
            value = frame.f_locals.get(name)
            if isinstance(value, Source):  # an opened input names the path it was opened from
                value = value.path
            if isinstance(value, (str, Path)) and str(value) and str(value) not in found:
                try:
                    if not exist or Path(value).exists():
                        found.append(str(value))
                except (OSError, ValueError):
                    continue
    return found


def _where(err: BaseException, argv: Sequence[str], names: Sequence[str] = PATH_LOCALS) -> str:
    named = _paths_in(err.__traceback__, names)
    if named:
        return named[0]
    given = [a for a in argv if not a.startswith("-") and Path(a).exists()]
    return ", ".join(given) if given else "the input"


def as_port_error(err: BaseException, argv: Sequence[str]) -> PortError:
    """The PortError that `err` (not a PortError itself) stands for."""
    text = str(err)
    if any(s in text for s in DISK_FULL):
        written = _paths_in(err.__traceback__, OUT_LOCALS, exist=False)  # a partial output is gone by now
        where = f"{written[0]}: " if written else ""
        return DiskSpaceError(f"{where}the disk is full ({text}).", hint="Free some space and run it again.")
    if isinstance(err, RecursionError):
        return InputError(f"{_where(err, argv)}: nested too deeply to read ({text}); refused.",
                          hint="The file is damaged or hostile; no file flux-port reads nests that deep.")
    from porting.resources import ESTIMATES, allocation_failed, out_of_memory

    if allocation_failed(err) and (ESTIMATES or not isinstance(err, MemoryError)):
        named = _paths_in(err.__traceback__)
        return out_of_memory(err, named[0] if named else "")
    if isinstance(err, MemoryError):  # a reader, before any estimate: the file (or an option) is the cause
        return InputError(f"{_where(err, argv)}: reading it would need more memory than this machine has "
                          f"(MemoryError{': ' + text if text else ''}).",
                          hint="Is the file damaged, or an option (a size, a count) far larger than meant?")
    if isinstance(err, INPUT_ERRORS):
        return InputError(f"{_where(err, argv)}: cannot be read ({type(err).__name__}: {text}).",
                          hint="The file is damaged or not what this verb expects; FLUX_PORT_DEBUG=1 shows where.")
    return InternalError(f"{type(err).__name__}: {text}")
