"""Named tensor operations used by mapping tables, each with a known inverse.

An operation maps a list of input tensors to a list of output tensors. `shapes` predicts output shapes from input
shapes without data, which is what the strict plan checks before any tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import torch

from porting.errors import MappingTableError

Shape = tuple[int, ...]


class OpShapeError(ValueError):
    """Input shapes do not fit the operation (reported per key by the planner)."""


# Byte ranges of the inputs that make up each output, in order: [(input index, byte offset, byte length), ...] per
# output. Only ops that move whole rows along dim 0 of row-major tensors can say this; the others return None.
ByteRanges = list[list[tuple[int, int, int]]]


def _nbytes(shape: Shape, itemsize: int) -> int:
    n = itemsize
    for s in shape:
        n *= s
    return n


class _ShapePreserving:
    """One tensor in, one tensor of the same shape out."""

    n_in = 1

    def n_out(self) -> int:
        return 1

    def shapes(self, in_shapes: list[Shape]) -> list[Shape]:
        return [in_shapes[0]]


@dataclass(frozen=True)
class Rename(_ShapePreserving):
    """One tensor in, the same tensor out under another name."""

    name = "rename"

    def apply(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [tensors[0]]

    def byte_ranges(self, in_shapes: list[Shape], itemsize: int) -> ByteRanges | None:
        return [[(0, 0, _nbytes(in_shapes[0], itemsize))]]

    def inverse(self) -> "Rename":
        return self


@dataclass(frozen=True)
class Split:
    """One tensor in, consecutive parts along `dim` out; `sizes` None means equal parts."""

    dim: int
    parts: int
    sizes: tuple[int, ...] | None = None

    name = "split"
    n_in = 1

    def n_out(self) -> int:
        return self.parts

    def _sizes(self, shape: Shape) -> tuple[int, ...]:
        if self.dim >= len(shape):
            raise OpShapeError(f"split along dim {self.dim} of a {len(shape)}-d tensor {list(shape)}")
        total = shape[self.dim]
        if self.sizes is None:
            if total % self.parts:
                raise OpShapeError(f"cannot split {total} rows into {self.parts} equal parts")
            return (total // self.parts,) * self.parts
        if sum(self.sizes) != total:
            raise OpShapeError(f"split sizes {list(self.sizes)} sum to {sum(self.sizes)}, tensor has {total} "
                               f"along dim {self.dim} (shape {list(shape)})")
        return self.sizes

    def shapes(self, in_shapes: list[Shape]) -> list[Shape]:
        shape = in_shapes[0]
        out = []
        for size in self._sizes(shape):
            s = list(shape)
            s[self.dim] = size
            out.append(tuple(s))
        return out

    def apply(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch

        return list(torch.split(tensors[0], list(self._sizes(tuple(tensors[0].shape))), dim=self.dim))

    def byte_ranges(self, in_shapes: list[Shape], itemsize: int) -> ByteRanges | None:
        if self.dim != 0:
            return None
        shape = in_shapes[0]
        row = _nbytes(shape[1:], itemsize)
        out, start = [], 0
        for size in self._sizes(shape):
            out.append([(0, start * row, size * row)])
            start += size
        return out

    def inverse(self) -> "Concat":
        return Concat(self.dim, self.parts, self.sizes)


@dataclass(frozen=True)
class Concat:
    """Several tensors in, one tensor out, joined along `dim`; `sizes` (if known) are checked."""

    dim: int
    parts: int
    sizes: tuple[int, ...] | None = None

    name = "concat"

    @property
    def n_in(self) -> int:
        return self.parts

    def n_out(self) -> int:
        return 1

    def shapes(self, in_shapes: list[Shape]) -> list[Shape]:
        first = in_shapes[0]
        if self.dim >= len(first):
            raise OpShapeError(f"concat along dim {self.dim} of a {len(first)}-d tensor {list(first)}")
        for s in in_shapes:
            if len(s) != len(first) or any(a != b for i, (a, b) in enumerate(zip(s, first)) if i != self.dim):
                raise OpShapeError(f"cannot concatenate shapes {[list(x) for x in in_shapes]} along dim {self.dim}")
        got = tuple(s[self.dim] for s in in_shapes)
        if self.sizes is None and len(set(got)) > 1:
            # the inverse of an unsized concat splits into equal parts, which would not give these parts back
            raise OpShapeError(f"parts have unequal sizes {list(got)} along dim {self.dim}; a concat of unequal parts "
                               "needs `sizes` in the table so its inverse can split them back")
        if self.sizes is not None and got != self.sizes:
            raise OpShapeError(f"parts have sizes {list(got)} along dim {self.dim}, "
                               f"the table expects {list(self.sizes)}")
        out = list(first)
        out[self.dim] = sum(got)
        return [tuple(out)]

    def apply(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch

        return [torch.cat(tensors, dim=self.dim)]

    def byte_ranges(self, in_shapes: list[Shape], itemsize: int) -> ByteRanges | None:
        if self.dim != 0:
            return None
        self.shapes(in_shapes)  # the same checks as the plan
        return [[(i, 0, _nbytes(s, itemsize)) for i, s in enumerate(in_shapes)]]

    def inverse(self) -> Split:
        return Split(self.dim, self.parts, self.sizes)


@dataclass(frozen=True)
class SwapHalves:
    """Exchange the two halves along `dim` ([a; b] -> [b; a]); its own inverse."""

    dim: int

    name = "swap_halves"
    n_in = 1

    def n_out(self) -> int:
        return 1

    def shapes(self, in_shapes: list[Shape]) -> list[Shape]:
        shape = in_shapes[0]
        if self.dim >= len(shape) or shape[self.dim] % 2:
            raise OpShapeError(f"cannot swap halves of shape {list(shape)} along dim {self.dim}")
        return [shape]

    def apply(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        import torch

        a, b = tensors[0].chunk(2, dim=self.dim)
        return [torch.cat([b, a], dim=self.dim)]

    def byte_ranges(self, in_shapes: list[Shape], itemsize: int) -> ByteRanges | None:
        if self.dim != 0:
            return None
        self.shapes(in_shapes)
        half = _nbytes(in_shapes[0], itemsize) // 2
        return [[(0, half, half), (0, 0, half)]]

    def inverse(self) -> "SwapHalves":
        return self


@dataclass(frozen=True)
class Cast(_ShapePreserving):
    """Change dtype. The inverse casts back; exact only when the forward cast widened (bf16 -> fp32)."""

    dtype: torch.dtype
    source_dtype: torch.dtype | None = None

    name = "cast"

    def apply(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [tensors[0].to(self.dtype)]

    def byte_ranges(self, in_shapes: list[Shape], itemsize: int) -> ByteRanges | None:
        return None  # changes the bytes

    def inverse(self) -> "Cast":
        if self.source_dtype is None:
            raise ValueError("the inverse of a cast needs the source dtype")
        return Cast(self.source_dtype, self.dtype)


Op = Rename | Split | Concat | SwapHalves | Cast


def resolve_size(value: Any, config: Mapping[str, Any], where: str) -> int:
    """A size in a table is an int or the name of a config value (`inner_dim`, `mlp_hidden`)."""
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value in config:
        return int(config[value])
    raise MappingTableError(f"{where}: size {value!r} is neither a number nor a config value "
                            f"(known: {', '.join(sorted(config))}).")


def op_from_spec(spec: Mapping[str, Any] | None, n_sources: int, n_targets: int, config: Mapping[str, Any] | None,
                 where: str) -> Op:
    """Build the original->diffusers operation of a rule from its table entry, checking its arity."""
    if spec is None:
        if (n_sources, n_targets) != (1, 1):
            raise MappingTableError(f"{where}: {n_sources} -> {n_targets} keys needs an `op` (split or concat).")
        return Rename()
    name = spec.get("name")
    dim = int(spec.get("dim", 0))
    if name == "rename":
        op: Op = Rename()
    elif name == "swap_halves":
        op = SwapHalves(dim)
    elif name in ("split", "concat"):
        parts = n_targets if name == "split" else n_sources
        sizes = None
        if "sizes" in spec:
            if len(spec["sizes"]) != parts:
                raise MappingTableError(f"{where}: {name} lists {len(spec['sizes'])} sizes for {parts} parts.")
            if config is not None:
                sizes = tuple(resolve_size(v, config, where) for v in spec["sizes"])
        op = Split(dim, parts, sizes) if name == "split" else Concat(dim, parts, sizes)
    else:
        raise MappingTableError(f"{where}: unknown operation {name!r} (known: rename, split, concat, swap_halves).")
    n_out = op.n_out()
    n_in = op.n_in
    if (n_in, n_out) != (n_sources, n_targets):
        raise MappingTableError(f"{where}: operation {name} takes {n_in} -> {n_out} keys, rule lists "
                                f"{n_sources} -> {n_targets}.")
    return op
