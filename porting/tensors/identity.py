"""The weights identity convert records and validate / publish recompute: one sha256 over every tensor."""

from __future__ import annotations

import hashlib
import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class _Readable(Protocol):
    @property
    def tensors(self) -> dict: ...

    def read(self, key: str) -> torch.Tensor: ...


class WeightsHasher:
    """Identity of a set of weights, independent of file layout and tensor order.

    sha256 over the sorted lines `key|dtype|shape|sha256(bytes)`; `hash_checkpoint` recomputes it from files, so
    validate and publish can prove they look at the weights convert wrote.
    """

    def __init__(self) -> None:
        self._lines: dict[str, str] = {}
        self._lock = threading.Lock()

    def update(self, key: str, tensor: torch.Tensor, dtype: str) -> None:
        self.add(key, dtype, tuple(tensor.shape), hashlib.sha256(tensor_bytes(tensor)).hexdigest())

    def add(self, key: str, dtype: str, shape: tuple[int, ...], digest: str) -> None:
        """Record a tensor whose bytes were hashed elsewhere (e.g. by the writer, piece by piece)."""
        with self._lock:
            self._lines[key] = f"{key}|{dtype}|{list(shape)}|{digest}\n"

    def hexdigest(self) -> str:
        h = hashlib.sha256()
        for key in sorted(self._lines):
            h.update(self._lines[key].encode())
        return h.hexdigest()


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The row-major bytes of a tensor (a view where possible, no copy for contiguous CPU tensors)."""
    import torch

    t = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def hash_checkpoint(ckpt: _Readable, prefix: str = "") -> str:
    """The weights identity of a checkpoint's tensors (those under `prefix`, prefix removed), read one at a time."""
    hasher = WeightsHasher()
    for key, info in ckpt.tensors.items():
        if key.startswith(prefix):
            hasher.update(key[len(prefix):], ckpt.read(key), info.dtype)
    return hasher.hexdigest()
