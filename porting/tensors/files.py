"""One positioned reader per input file: the file is opened once, when its header is read, and every later read of
its data (the reader, the shard writer's copies, merge, the GGUF decoder, the exporters) goes through that one
descriptor with positioned reads (`os.preadv`, safe from any thread; no mmap, so resident memory stays at the bytes
asked for).

The descriptor is held by the tensors the header described (`TensorInfo.reader`), so it pins the very inode whose
header was parsed: a file replaced after the header read is still read as the header described it, and
`Source.check_unchanged` tells the user it changed. It is closed when the last of those tensors is gone.
`reader_for(path)` hands out the live reader of a path (the latest header read of it), or opens one.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

from porting.errors import InputError

_LIVE: weakref.WeakValueDictionary[str, FileReader] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


class FileReader:
    """A file opened once for positioned reads."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise InputError(f"{path}: cannot read ({e.strerror}).") from e
        self._finalizer = weakref.finalize(self, os.close, self.fd)
        with _LOCK:
            _LIVE[_key(self.path)] = self

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def read_into(self, view: memoryview, offset: int, what: str = "") -> None:
        """Fill `view` from byte `offset` on; a short file is an error naming `what`."""
        done = 0
        while done < view.nbytes:
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise InputError(f"{self.path}: unexpected end of file while reading {what or 'it'}.")
            done += n

    def read(self, offset: int, nbytes: int, what: str = "") -> bytes:
        buf = bytearray(nbytes)
        self.read_into(memoryview(buf), offset, what)
        return bytes(buf)

    def advise(self, offset: int, length: int, advice: str) -> None:
        """posix_fadvise where the platform has it ("sequential" read-ahead, "dontneed" once read)."""
        if hasattr(os, "posix_fadvise"):
            flag = {"sequential": os.POSIX_FADV_SEQUENTIAL, "dontneed": os.POSIX_FADV_DONTNEED}[advice]
            os.posix_fadvise(self.fd, offset, length, flag)

    def close(self) -> None:
        self._finalizer()


def _key(path: Path) -> str:
    return os.path.abspath(path)


def reader_for(path: Path) -> FileReader:
    """The live reader of `path` (opened when its header was read), or a new one."""
    with _LOCK:
        live = _LIVE.get(_key(Path(path)))
    return live if live is not None else FileReader(Path(path))


__all__ = ["FileReader", "reader_for"]
