"""Every quantized safetensors layout flux-port knows, one line each: the one place a new layout is added.

A layout is a module beside this one (or a folder, as `svdq/`) that declares a `base.Layout`: its name, its markers,
its sidecar names, what it refuses, and how it decodes. Everything that used to be a hand list is derived here:
the order `decode` asks the layouts in (refused ones first, then the marked ones, then, only when none of those
claims the file, the ones told apart by their sidecars), the sidecar names (`porting.tensors.sidecars`), the
metadata keys that make a file worth a look, and the formats refused by name.
"""

from __future__ import annotations

from . import awq_w4a16, bfl_scheme, comfy_mixed, comfy_scaled_fp8, modelopt_int8
from .base import Layout
from .svdq import lite as svdq_lite
from .svdq import reader as svdq

# recognised and refused: packed int4 with zero points has no exact way to plain weights here
AWQ_GPTQ = Layout("AWQ / GPTQ (packed int4 with zero points)", sidecars=("qweight", "qzeros"),
                  markers=("qweight", "qzeros"), refused=True)

LAYOUTS: list[Layout] = [
    AWQ_GPTQ,
    comfy_mixed.LAYOUT,
    comfy_scaled_fp8.LAYOUT,
    svdq.LAYOUT,
    svdq_lite.LAYOUT,
    awq_w4a16.LAYOUT,
    bfl_scheme.LAYOUT,
    modelopt_int8.LAYOUT,
]


def refused() -> list[Layout]:
    return [layout for layout in LAYOUTS if layout.refused]


def declared() -> list[Layout]:
    """Layouts a marker in the file declares (tried together: two claiming one file is an error)."""
    return [layout for layout in LAYOUTS if layout.marked and not layout.refused]


def by_sidecars() -> list[Layout]:
    """Layouts without a marker, told apart by their sidecars' dtypes and shapes; asked when no marked one claims."""
    return [layout for layout in LAYOUTS if not layout.marked and not layout.refused]


def sidecar_names() -> frozenset[str]:
    return frozenset(name for layout in LAYOUTS for name in layout.sidecars)


def metadata_keys() -> frozenset[str]:
    return frozenset(key for layout in LAYOUTS for key in layout.metadata_keys)


def refused_formats() -> dict[tuple[str, str], str]:
    """Every format refused by name, (layout, format as the file names it) -> what it is; a layout refused whole is
    (its name, its name)."""
    out = {(layout.name, layout.name): layout.name for layout in refused()}
    out.update({(layout.name, fmt): what for layout in LAYOUTS for fmt, what in layout.refuses.items()})
    return out


__all__ = ["LAYOUTS", "Layout", "refused", "declared", "by_sidecars", "sidecar_names", "metadata_keys",
           "refused_formats"]
