"""The carry between pipeline stages over torch.distributed send/recv: a description of every tensor (shape, dtype)
first, then the tensors."""

from __future__ import annotations

from typing import Any

import torch


def _pack(state: dict[str, Any]) -> tuple[list[Any], list[torch.Tensor]]:
    """A state as (a picklable description, its tensors in order)."""
    meta, tensors = [], []
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            meta.append((key, "t", (tuple(value.shape), value.dtype)))
            tensors.append(value)
        elif isinstance(value, tuple) and value and all(isinstance(v, torch.Tensor) for v in value):
            meta.append((key, "tuple", [(tuple(v.shape), v.dtype) for v in value]))
            tensors.extend(value)
        else:
            meta.append((key, "v", value))
    return meta, tensors


def _unpack(meta: list[Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    it = iter(tensors)
    for key, kind, value in meta:
        if kind == "t":
            out[key] = next(it)
        elif kind == "tuple":
            out[key] = tuple(next(it) for _ in value)
        else:
            out[key] = value
    return out


class Link:
    """send/recv between ranks on the backend's device (CPU for gloo, the rank's accelerator otherwise)."""

    def __init__(self, comm: torch.device) -> None:
        import torch.distributed as dist

        self.dist, self.comm = dist, comm

    def send_object(self, obj: Any, dst: int) -> None:
        self.dist.send_object_list([obj], dst=dst, device=self.comm)

    def recv_object(self, src: int) -> Any:
        box = [None]
        self.dist.recv_object_list(box, src=src, device=self.comm)
        return box[0]

    def send_tensors(self, meta: Any, tensors: list[torch.Tensor], dst: int) -> None:
        self.send_object(meta, dst)  # shapes and dtypes first
        for t in tensors:
            self.dist.send(t.detach().contiguous().to(self.comm), dst=dst)

    def recv_tensors(self, src: int, shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        out = []
        for shape, dtype in shapes:
            t = torch.empty(shape, dtype=dtype, device=self.comm)
            self.dist.recv(t, src=src)
            out.append(t)
        return out

    def send_states(self, states: list[dict[str, Any]], extra: Any, dst: int) -> None:
        packed = [_pack(s) for s in states]
        self.send_tensors(([m for m, _ in packed], extra), [t for _, ts in packed for t in ts], dst)

    def recv_states(self, src: int) -> tuple[list[dict[str, Any]], Any]:
        metas, extra = self.recv_object(src)
        shapes = []
        for meta in metas:
            for _, kind, value in meta:
                if kind == "t":
                    shapes.append(value)
                elif kind == "tuple":
                    shapes.extend(value)
        tensors = iter(self.recv_tensors(src, shapes))
        states = []
        for meta in metas:
            n = sum(1 if kind == "t" else len(value) for _, kind, value in meta if kind != "v")
            states.append(_unpack(meta, [next(tensors) for _ in range(n)]))
        return states, extra


def _to(state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The same bits on `device` (where the run that owns the state computes)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.to(device)
        elif isinstance(v, tuple) and v and all(isinstance(t, torch.Tensor) for t in v):
            out[k] = tuple(t.to(device) for t in v)
        else:
            out[k] = v
    return out
