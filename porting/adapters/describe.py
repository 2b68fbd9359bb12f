"""`port inspect ADAPTER`: naming, kinds, ranks, alphas, targeted modules and the base variants it fits (headers)."""

from __future__ import annotations

import re
from collections import Counter
from typing import TYPE_CHECKING, Any, Mapping

from porting.families import family_for, get_family
from porting.inputs.adapter_keys import Adapter

from .delta import delta_shape, rank, scale

if TYPE_CHECKING:
    from porting.inputs import SourceLike

BLOCK_INDEX = re.compile(r"\.(\d+)\.")


def variant_configs(table: str) -> Mapping[str, Mapping[str, Any]]:
    """Released configurations to test an adapter against: the real configs its family declares."""
    return get_family(table).real_configs


def fits(adapter: Adapter) -> dict[str, str | None]:
    """For each released variant: None when every module lands with its shape, else the first reason it does not."""
    out: dict[str, str | None] = {}
    for name, config in variant_configs(adapter.table.name).items():
        shapes = family_for(adapter.table).expected_shapes(config, adapter.naming)
        why = None
        for m in adapter.modules.values():
            got = delta_shape(adapter, m)
            if m.param not in shapes:
                why = f"{m.param} is not in {name}"
                break
            if shapes[m.param] != got:
                why = f"{m.param}: {list(got)} vs {list(shapes[m.param])}"
                break
        out[name] = why
    return out


def describe_adapter(src: SourceLike) -> dict[str, Any]:
    """`port inspect ADAPTER` as a document; `src` is an adapter file or folder, or its opened `Source`."""
    from porting.inputs import as_source, shown

    adapter = as_source(src, kind="adapter").read_adapter()  # its own best table, whatever base it may meet
    path = shown(src)
    ranks = Counter(str(rank(adapter, m)) if rank(adapter, m) is not None else "full"
                    for m in adapter.modules.values())
    alphas = Counter("none" if m.alpha is None else f"{m.alpha:g}" for m in adapter.modules.values())
    scales = Counter(f"{scale(adapter, m):g}" for m in adapter.modules.values())
    targets = Counter(BLOCK_INDEX.sub(".N.", m.module) for m in adapter.modules.values())
    fit = fits(adapter)
    return {
        "path": str(path), "kind": "adapter", "family": adapter.table.name, "format": adapter.format,
        "naming": adapter.naming, "key_style": adapter.style, "prefix": adapter.prefix,
        "kinds": adapter.kinds, "modules": len(adapter.modules), "tensors": len(adapter.ckpt.tensors),
        "parameters": adapter.ckpt.parameter_count, "bytes": adapter.ckpt.total_bytes, "dtypes": adapter.ckpt.dtypes(),
        "ranks": dict(ranks), "alphas": dict(alphas), "scales": dict(scales),
        "metadata_scale": adapter.metadata_scale, "targets": dict(sorted(targets.items())),
        "fits": [name for name, why in fit.items() if why is None],
        "does_not_fit": {name: why for name, why in fit.items() if why is not None},
        "unreadable": [{"key": k, "why": why} for k, why in adapter.unknown],
    }
