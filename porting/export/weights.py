"""A component folder's weights as the exporters read them: its headers read once (`open_source`), each tensor read
through its file's one positioned reader, whole or a slice of rows; no `safe_open`, which maps the whole file for
every tensor it hands out."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from porting.errors import InputError

if TYPE_CHECKING:
    import torch

    from porting.tensors.reader import TensorInfo


class ComponentWeights:
    """The tensors of one component folder (one file, or shards with their index), by stored key."""

    def __init__(self, folder: Path) -> None:
        from porting.inputs import open_source

        self.folder = Path(folder)
        self.view = open_source(self.folder, kind="weights").view

    def __contains__(self, key: str) -> bool:
        return key in self.view.tensors

    def keys(self) -> list[str]:
        return list(self.view.tensors)

    def info(self, key: str) -> TensorInfo:
        if key not in self.view.tensors:
            raise InputError(f"{self.folder}: no tensor {key} in its safetensors files.")
        return self.view.tensors[key]

    def file(self, key: str) -> Path:
        return self.info(key).file

    def shape(self, key: str) -> list[int]:
        return list(self.info(key).shape)

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        """The tensor, or rows [start, stop) of dim 0 (a step-1 slice)."""
        if rows is None:
            return self.view.read(key)
        n = self.info(key).shape[0]
        start, stop, step = rows.indices(n)
        if step != 1:
            raise InputError(f"{self.folder}: {key}: rows are read in one contiguous range (step {step}).")
        return self.view.read(key, (start, stop))


__all__ = ["ComponentWeights"]
