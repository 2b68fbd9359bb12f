"""The model families flux-port knows, one registered unit each (see `base.Family`).

The engine, publish, recipes, the demo and validate ask this registry; no family name is tested outside its own
module. Families are kept sorted by name, so detection and listings never depend on load order.
"""

from __future__ import annotations

from typing import Mapping

from porting.families.mapping import MappingTable

from .base import Family, PipelineVariant
from .flux1 import FAMILY as FLUX1
from .flux2 import FAMILY as FLUX2

_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family (a test's toy family, a plug-in); its name must be new."""
    if family.name in _REGISTRY and _REGISTRY[family.name] is not family:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    _REGISTRY[family.name] = family
    return family


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def families() -> list[Family]:
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def get_family(name: str) -> Family:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no model family {name!r} (known: {', '.join(sorted(_REGISTRY))})") from None


def family_for(table: MappingTable) -> Family:
    """The family of a table: the registered one, or for a table loaded from a file with the name of a
    registered family, that family bound to the file's table."""
    family = _REGISTRY.get(table.name)
    if family is None:
        raise KeyError(f"mapping table {table.name!r} belongs to no registered model family")
    if family.table == table:
        return family
    return type(family)(table=table, folder=family._folder)


def family_for_class(class_name: str) -> Family:
    """The family whose diffusers transformer class is `class_name` (a config's `_class_name`)."""
    for family in families():
        if family.diffusers_class == class_name:
            return family
    raise KeyError(f"no model family has the diffusers class {class_name!r} (known: "
                   f"{', '.join(f.diffusers_class for f in families())})")


def builtin_tables() -> dict[str, MappingTable]:
    """Every registered family's table, by name, in name order."""
    return {f.name: f.table for f in families()}


def pipeline_variants() -> Mapping[str, tuple[Family, PipelineVariant]]:
    """Every publishable variant (klein, klein-kv, dev, ...) with its family."""
    return {name: (f, v) for f in families() for name, v in f.pipelines.items()}


for _family in (FLUX1, FLUX2):
    register(_family)

__all__ = ["Family", "PipelineVariant", "register", "unregister", "families", "get_family", "family_for",
           "family_for_class", "builtin_tables", "pipeline_variants"]
