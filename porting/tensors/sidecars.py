"""Key names that only mean something next to a quantized weight (torch-free, so header-only verbs can check).

A key ending in one of them that no layout consumed must never be dropped silently: it would leave a raw quantized
weight behind as if it were the weight. The names are the layouts' own (`quant/registry.py`), read when first asked:
importing this module does not load the layouts.
"""

from __future__ import annotations

from typing import Iterable, Mapping


def sidecar_names() -> frozenset[str]:
    from .quant.registry import sidecar_names as names

    return names()


def is_sidecar(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in sidecar_names()


def may_be_quantized(keys: Iterable[str], metadata: Mapping[str, str]) -> bool:
    """False when no quantized layout can apply: no sidecar key and no metadata entry that declares a layout."""
    from .quant.registry import metadata_keys

    names = sidecar_names()
    return any(k in metadata for k in metadata_keys()) or any(k.rsplit(".", 1)[-1] in names for k in keys)
