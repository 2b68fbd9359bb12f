"""What every quantized safetensors layout shares: per-layer schemes, the decoder, and the rewritten checkpoint.

A layout module (one per producer's format) decides from the header which layers are quantized and with which
scheme; this module turns that into a `Checkpoint` whose quantized weights are computed tensors (float32) and whose
sidecar tensors (scales, markers) are gone from the key set, folded into the weights or reported as dropped.

Finding the layers reads headers only; torch (and the kernels) are imported when a weight is dequantized, so
`port inspect` of a quantized file stays torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping

from porting.errors import InputError, UnsupportedQuantizationError
from porting.finite import check_scales

from ..dtypes import nbytes
from ..reader import Checkpoint, Quantization, TensorInfo, read_stored

if TYPE_CHECKING:
    import torch


class Parts:
    """The stored tensors of one layer, by role (`weight`, `weight_scale`, ...), read on demand."""

    def __init__(self, layer: "Layer", cache: dict[str, torch.Tensor]) -> None:
        self.layer = layer
        self._cache = cache

    def info(self, role: str) -> TensorInfo:
        return self.layer.parts[role]

    def rows(self, role: str, rows: tuple[int, int]) -> torch.Tensor:
        """Rows [a, b) of a part stored one row per output row (the weight, per-row scales)."""
        return read_stored(self.layer.parts[role], rows)

    def whole(self, role: str) -> torch.Tensor:
        """A whole part, kept for the layer's next row block (scales); a scale is checked as it is read."""
        if role not in self._cache:
            info = self.layer.parts[role]
            t = read_stored(info)
            if role != "weight":
                self.layer.scheme.check_scale(role, t, info)
            self._cache[role] = t
        return self._cache[role]


class Scheme:
    """How one kind of quantized weight is stored and dequantized."""

    name: str
    required: tuple[str, ...] = ()  # sidecar roles besides `weight`
    optional: tuple[str, ...] = ()  # consumed when present

    def shape(self, parts: Mapping[str, TensorInfo]) -> tuple[int, ...]:
        return parts["weight"].shape

    def check(self, parts: Mapping[str, TensorInfo]) -> str | None:
        """A reason the stored shapes do not fit this scheme, or None."""
        return None

    def check_scale(self, role: str, t: torch.Tensor, info: TensorInfo) -> None:
        """Refuse a scale that is zero, negative or not finite (scales of one tensor or one row)."""
        check_scales(t, repr(info.name), info.file)

    def dequantize(self, parts: Parts, rows: tuple[int, int], dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows [a, b) dequantized in float32, rounded once to `dtype` (None: float32)."""
        out = self.dequantize_f32(parts, rows)
        return out if dtype is None or dtype == out.dtype else out.to(dtype)

    def dequantize_f32(self, parts: Parts, rows: tuple[int, int]) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class Scaled(Scheme):
    """weight * scale, the scale per tensor or per output row (fp8, int8 tensorwise / per-channel)."""

    name: str
    scale_role: str = "weight_scale"
    per_row: bool | None = None  # None: either
    weight_dtypes: tuple[str, ...] = ("F8_E4M3", "F8_E5M2", "I8")

    @property
    def required(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.scale_role,)

    def check(self, parts: Mapping[str, TensorInfo]) -> str | None:
        w, s = parts["weight"], parts[self.scale_role]
        if w.dtype not in self.weight_dtypes:
            return f"weight is {w.dtype}, expected one of {', '.join(self.weight_dtypes)}"
        rows = w.shape[0] if w.shape else 1
        if s.numel == 1 and self.per_row is not True:
            return None
        if s.numel == rows and len(w.shape) == 2 and self.per_row is not False and s.shape in ((rows,), (rows, 1)):
            return None
        if s.numel != rows and len(s.shape) <= 2 and s.numel > 1:
            return (f"the scale has {s.numel} values and the weight {list(w.shape)} has {rows} rows: a per-row scale "
                    f"needs {rows} values (one per output row), a per-tensor one 1")
        return (f"scale {list(s.shape)} is neither one value (per tensor) nor [{rows}] / [{rows}, 1] (one per row) "
                f"for weight {list(w.shape)}")

    def dequantize(self, parts: Parts, rows: tuple[int, int], dtype: torch.dtype | None = None) -> torch.Tensor:
        import torch

        from . import kernels

        dtype = torch.float32 if dtype is None else dtype
        if parts.info(self.scale_role).numel == 1:
            # one scale: each of the 256 codes has one dequantized value; a table lookup gives the same values
            # as the float32 product rounded to `dtype`, several times faster
            key = f"_table_{dtype}"
            if key not in parts._cache:
                codes = parts.info("weight").torch_dtype
                parts._cache[key] = kernels.code_table(codes, parts.whole(self.scale_role), dtype)
            return kernels.lookup(parts.rows("weight", rows), parts._cache[key])
        return super().dequantize(parts, rows, dtype)

    def dequantize_f32(self, parts: Parts, rows: tuple[int, int]) -> torch.Tensor:
        w = parts.rows("weight", rows)
        scale = parts.whole(self.scale_role).reshape(-1)[rows[0]:rows[1]]
        from . import kernels

        return kernels.scaled(w, scale)


@dataclass(frozen=True)
class NVFP4(Scheme):
    """Packed E2M1 pairs [N, K/2], E4M3 block-16 scales, fp32 global scale `weight_scale_2`."""

    name: str
    high_first: bool
    swizzled: bool

    required = ("weight_scale", "weight_scale_2")

    def shape(self, parts: Mapping[str, TensorInfo]) -> tuple[int, ...]:
        n, half_k = parts["weight"].shape
        return (n, 2 * half_k)

    def check(self, parts: Mapping[str, TensorInfo]) -> str | None:
        w, s, s2 = parts["weight"], parts["weight_scale"], parts["weight_scale_2"]
        if w.dtype != "U8" or len(w.shape) != 2:
            return f"nvfp4 weight must be uint8 [N, K/2], is {w.dtype} {list(w.shape)}"
        n, k = self.shape(parts)
        if k % 16:
            return f"K = {k} is not a multiple of the 16-element block"
        if s2.numel != 1:
            return f"weight_scale_2 must be one value, is {list(s2.shape)}"
        want = ((-(-n // 128) * 128, -(-(k // 16) // 4) * 4) if self.swizzled else (n, k // 16))
        if s.numel != want[0] * want[1]:
            layout = "swizzled, padded to 128 x 4 tiles" if self.swizzled else "row-major"
            return f"block scales {list(s.shape)} do not fit {layout} scales {list(want)} for a [{n}, {k}] weight"
        return None

    def check_scale(self, role: str, t: torch.Tensor, info: TensorInfo) -> None:
        check_scales(t, repr(info.name), info.file, zero_ok=role == "weight_scale")  # 0: a block of zeros

    def _scales(self, parts: Parts) -> torch.Tensor:
        from . import kernels

        key = "_unswizzled"
        if key not in parts._cache:
            n, k = self.shape(parts.layer.parts)
            raw = parts.whole("weight_scale")
            parts._cache[key] = (kernels.unswizzle_scales(raw, n, k // 16) if self.swizzled
                                 else raw.reshape(n, k // 16)).float()
        return parts._cache[key]

    def dequantize_f32(self, parts: Parts, rows: tuple[int, int]) -> torch.Tensor:
        a, b = rows
        from . import kernels

        return kernels.nvfp4(parts.rows("weight", rows), self._scales(parts)[a:b], parts.whole("weight_scale_2"),
                             self.high_first)


@dataclass(frozen=True)
class MXFP8(Scheme):
    """fp8 weight [N, K], E8M0 block-32 scales in the swizzled layout."""

    name: str

    required = ("weight_scale",)

    def check(self, parts: Mapping[str, TensorInfo]) -> str | None:
        w, s = parts["weight"], parts["weight_scale"]
        if len(w.shape) != 2 or w.shape[1] % 32:
            return f"mxfp8 weight must be [N, K] with K a multiple of 32, is {list(w.shape)}"
        n, k = w.shape
        want = (-(-n // 128) * 128) * (-(-(k // 32) // 4) * 4)
        if s.numel != want or s.dtype not in ("U8", "F8_E8M0"):
            return f"block scales {s.dtype} {list(s.shape)} do not fit swizzled E8M0 scales for [{n}, {k}]"
        return None

    def check_scale(self, role: str, t: torch.Tensor, info: TensorInfo) -> None:
        """E8M0 exponents: 0xFF is NaN; every other byte is a power of two (or 0 as read here)."""
        import torch

        nan = t.view(torch.uint8) == 0xFF
        if bool(nan.any()):
            check_scales(torch.where(nan, torch.nan, 1.0), repr(info.name), info.file, zero_ok=True)

    def dequantize_f32(self, parts: Parts, rows: tuple[int, int]) -> torch.Tensor:
        import torch

        from . import kernels

        key = "_unswizzled"
        n, k = parts.info("weight").shape
        if key not in parts._cache:
            parts._cache[key] = kernels.unswizzle_scales(parts.whole("weight_scale").view(torch.uint8), n, k // 32)
        a, b = rows
        return kernels.mxfp8(parts.rows("weight", rows), parts._cache[key][a:b])


@dataclass
class Layer:
    key: str  # the weight's key, as the engine will see it
    scheme: Scheme
    parts: dict[str, TensorInfo]  # role -> stored tensor ("weight" and the scheme's sidecars)
    pre_quant_scale: TensorInfo | None = None


class QuantDecoder:
    """Dequantizes the layers of one checkpoint, a row block at a time; keeps one layer's scales."""

    def __init__(self, layers: Mapping[str, Layer]) -> None:
        self.layers = dict(layers)
        self._current: tuple[str, dict[str, torch.Tensor]] | None = None

    def dequantize(self, key: str, rows: tuple[int, int] | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        layer = self.layers[key]
        if self._current is None or self._current[0] != key:
            self._current = (key, {})
        n = layer.scheme.shape(layer.parts)[0]
        parts = Parts(layer, self._current[1])
        if layer.pre_quant_scale is None:
            return layer.scheme.dequantize(parts, rows or (0, n), dtype)
        # the layer computes W (x * s): the same function as the plain weight W * s over the input columns
        if "_pre_quant_scale" not in parts._cache:
            smooth = read_stored(layer.pre_quant_scale).float().reshape(1, -1)
            check_scales(smooth, repr(layer.pre_quant_scale.name), layer.pre_quant_scale.file)
            parts._cache["_pre_quant_scale"] = smooth
        out = layer.scheme.dequantize(parts, rows or (0, n)) * parts._cache["_pre_quant_scale"]
        return out if dtype is None or dtype == out.dtype else out.to(dtype)


@dataclass
class Found:
    """What a layout module found in a header."""

    format: str
    layers: dict[str, Layer] = field(default_factory=dict)
    consumed: set[str] = field(default_factory=set)  # stored keys folded into layers or markers
    dropped: list[str] = field(default_factory=list)
    dropped_why: str = ""
    notes: list[str] = field(default_factory=list)


def layer_parts(ckpt: Checkpoint, prefix: str, scheme: Scheme, found: Found,
                dropped: tuple[str, ...] = ("input_scale",), where: str = "") -> Layer:
    """Collect `<prefix>weight` and the scheme's sidecars; check shapes; record what is consumed and dropped."""
    tensors = ckpt.tensors
    weight_key = prefix + "weight"
    if weight_key not in tensors:
        raise InputError(f"{ckpt.path}: {where or scheme.name} sidecars for {prefix[:-1]!r} but no "
                         f"{weight_key!r} tensor.", hint="The file is incomplete or not in the layout it declares.")
    parts = {"weight": tensors[weight_key]}
    for role in scheme.required:
        if prefix + role not in tensors:
            raise InputError(f"{ckpt.path}: {weight_key!r} is {scheme.name} but {prefix + role!r} is missing.",
                             hint="The file is incomplete or not in the layout it declares.")
        parts[role] = tensors[prefix + role]
    for role in scheme.optional:
        if prefix + role in tensors:
            parts[role] = tensors[prefix + role]
    why = scheme.check(parts)
    if why:
        raise InputError(f"{ckpt.path}: {weight_key!r} ({scheme.name}): {why}.",
                         hint="The file does not follow the layout its header declares; flux-port will not guess.")
    pqs = tensors.get(prefix + "pre_quant_scale")
    if pqs is not None:
        k = scheme.shape(parts)[-1]
        if pqs.numel != k:
            raise InputError(f"{ckpt.path}: {prefix}pre_quant_scale has {pqs.numel} values, the weight has {k} "
                             "input columns.")
        found.consumed.add(prefix + "pre_quant_scale")
    found.consumed.update(p.name for p in parts.values())
    for role in dropped:
        if prefix + role in tensors:
            found.consumed.add(prefix + role)
            found.dropped.append(prefix + role)
    layer = Layer(weight_key, scheme, parts, pqs)
    found.layers[weight_key] = layer
    return layer


def rewrite(ckpt: Checkpoint, found: Found) -> Checkpoint:
    """The checkpoint as plain weights: quantized weights computed, sidecars gone; stored layout kept for inspect."""
    tensors: dict[str, TensorInfo] = {}
    # a layer that stores no `weight` (its codes are a part of another name: AWQ's `qweight`) stands where that is
    unstored = {layer.parts["weight"].name: layer for key, layer in found.layers.items() if key not in ckpt.tensors}
    for key, info in ckpt.tensors.items():
        layer = found.layers.get(key) or unstored.get(key)
        if layer is not None:
            shape = layer.scheme.shape(layer.parts)
            tensors[layer.key] = TensorInfo(layer.key, "F32", shape, info.file, info.start, nbytes(shape, "F32"),
                                            computed=True)
        elif key not in found.consumed:
            tensors[key] = info
    counts: dict[str, int] = {}
    for layer in found.layers.values():
        counts[layer.scheme.name] = counts.get(layer.scheme.name, 0) + 1
    folded = sorted(found.consumed - set(found.dropped) - set(found.layers))
    quant = Quantization(found.format, counts, folded, sorted(found.dropped), found.dropped_why, found.notes)
    return Checkpoint(ckpt.path, tensors, ckpt.files, ckpt.config, ckpt.metadata, stored=ckpt.tensors,
                      quantization=quant, decoder=QuantDecoder(found.layers), container=ckpt.container)


@dataclass(frozen=True, eq=False)
class Layout:
    """One quantized safetensors layout: what the registry (`registry.LAYOUTS`) knows of it, one declaration each.

    - `name`: what inspect, the manifest and the errors call it.
    - Recognised by `markers`, stored-key endings that all present declare it, or `metadata_keys`, header metadata
      entries that declare it; `recognise` replaces that test when the layout needs more (a dtype, a count). A
      layout with neither marker is told apart by its sidecars' dtypes and shapes, so `decode` asks it only when
      no marked layout claims the file.
    - `sidecars`: stored-key endings that mean nothing without a quantized weight of this layout. A file holding
      one is opened through the layouts; one that no layout consumed is never dropped silently.
    - `refuses`: formats inside the layout that flux-port recognises and refuses, each with what it is.
      `refused`: the whole layout is refused (no exact way to plain weights); it is asked before any other.
    - Decoded by `find` (its stored layers and sidecars, which `rewrite` turns into computed weights) or by `view`
      (a layout whose plain tensors are not its stored ones, renamed, split or joined, builds its own view).
    """

    name: str
    sidecars: tuple[str, ...]
    markers: tuple[str, ...] = ()
    metadata_keys: tuple[str, ...] = ()
    recognise: Callable[[Checkpoint], bool] | None = None
    find: Callable[[Checkpoint], Found] | None = None
    view: Callable[[Checkpoint], Checkpoint] | None = None
    refuses: Mapping[str, str] = field(default_factory=dict)
    refused: bool = False

    def __post_init__(self) -> None:
        decoders = (self.find is not None) + (self.view is not None)
        if decoders != (0 if self.refused else 1):
            raise TypeError(f"layout {self.name!r}: give exactly one of find or view (none when refused)")
        if not (self.markers or self.metadata_keys or self.recognise):
            raise TypeError(f"layout {self.name!r}: give markers, metadata_keys or recognise")
        if self.refused and not self.markers:
            raise TypeError(f"refused layout {self.name!r}: give the markers that name it")

    @property
    def marked(self) -> bool:
        """Declared by a marker in the file (not told apart by its sidecars alone)."""
        return bool(self.markers or self.metadata_keys)

    def claims(self, ckpt: Checkpoint) -> bool:
        if self.recognise is not None:
            return self.recognise(ckpt)
        metadata = ckpt.metadata or {}
        if any(k in metadata for k in self.metadata_keys):
            return True
        endings = {k.rsplit(".", 1)[-1] for k in ckpt.tensors}
        return bool(self.markers) and set(self.markers) <= endings

    def decode(self, ckpt: Checkpoint) -> Checkpoint:
        """The file seen as plain (computed) weights; a refused layout raises, naming itself and a stored key."""
        if self.refused:
            example = next(k for k in ckpt.tensors if k.rsplit(".", 1)[-1] == self.markers[0])
            raise UnsupportedQuantizationError(
                f"{ckpt.path}: quantized as {self.name} (e.g. {example!r}); flux-port refuses it: it cannot turn "
                "this layout into plain weights exactly. Nothing was written.",
                hint="Use an fp8, nvfp4, mxfp8, int8, GGUF or bf16 release of the same model.")
        if self.view is not None:
            return self.view(ckpt)
        assert self.find is not None
        return rewrite(ckpt, self.find(ckpt))


__all__ = ["Scheme", "Scaled", "NVFP4", "MXFP8", "Layer", "Found", "QuantDecoder", "Layout", "layer_parts",
           "rewrite"]


def weight_scale_layers(ckpt: Checkpoint, weight_dtypes: tuple[str, ...]) -> list[str]:
    """Layer prefixes (ending in '.') where a `weight_scale` sits next to a weight stored in one of `weight_dtypes`:
    the marker-less layouts (BFL scheme, ModelOpt) are told apart by that dtype."""
    out = []
    for key in ckpt.tensors:
        if key.endswith(".weight_scale"):
            prefix = key[: -len("weight_scale")]
            weight = ckpt.tensors.get(prefix + "weight")
            if weight is not None and weight.dtype in weight_dtypes:
                out.append(prefix)
    return out
