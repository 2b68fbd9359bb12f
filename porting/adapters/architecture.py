"""An adapter checked against its family's architecture when no base is given.

Each layer's shape is a formula in the family's sizes (`to_q` is [inner_dim, inner_dim], a fused qkv
[3*inner_dim, inner_dim]); the formulas come from the family's shape data at its probe configurations, in the
adapter's own naming. The sizes are those the adapter's modules pin (the value most modules give), so a module whose
difference cannot be its layer for the same model (a LoKr whose lokr_w1 x lokr_w2 make [68, 64] where every other
module says inner_dim = 64, or a square layer made non-square) is refused by key before anything is written. A base
(`--config`) checks the real shapes instead (`check_config`); sizes no module pins cannot be checked here.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Mapping

from porting.errors import InputError
from porting.families import family_for
from porting.families.generate_shapes import dim_expression
from porting.families.shapes import TERM, evaluate
from porting.inputs.adapter_keys import WIDE, Adapter, ModuleAdapter

from .delta import delta_shape

Dims = tuple["str | int | None", ...]


def formulas(adapter: Adapter) -> dict[str, Dims]:
    """Each module's layer shape as formulas in the family's sizes (None where no single formula fits)."""
    family = family_for(adapter.table)
    every = {f: WIDE for f in adapter.table.blocks.values()} | {flag: True for flag in adapter.table.present}
    runs = []
    for probe in family.shape_probes:
        config = {**probe, **every}
        runs.append((family.sizes(config), family.expected_shapes(config, adapter.naming)))
    out: dict[str, Dims] = {}
    for m in adapter.modules.values():
        shapes = [expected.get(m.param) for _, expected in runs]
        if not runs or any(s is None or len(s) != len(shapes[0]) for s in shapes):
            continue
        dims = []
        for i in range(len(shapes[0])):
            try:
                dims.append(dim_expression(shapes[0][i], [(sizes, s[i]) for (sizes, _), s in zip(runs, shapes)],
                                           family.shape_terms))
            except ValueError:
                dims.append(None)
        out[m.param] = tuple(dims)
    return out


def _pinned(formula: dict[str, Dims], got: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The sizes the modules pin through one-term dims (`k*size`): the value most modules give."""
    votes: dict[str, Counter] = {}
    for param, dims in formula.items():
        for expr, value in zip(dims, got[param]):
            m = TERM.match(expr) if isinstance(expr, str) else None
            if m and value % int(m.group(1) or 1) == 0:
                votes.setdefault(m.group(2), Counter())[value // int(m.group(1) or 1)] += 1
    return {name: counts.most_common(1)[0][0] for name, counts in votes.items()}


def _expected(dims: Dims, sizes: dict[str, int], got: tuple[int, ...]) -> tuple[int, ...] | None:
    """The layer's shape under `sizes`, each dim it cannot size taken as given; None when rank differs."""
    if len(dims) != len(got):
        return None
    out = []
    for expr, value in zip(dims, got):
        try:
            out.append(value if expr is None else evaluate(expr, sizes))
        except ValueError:  # a size no module pins: not checkable here
            out.append(value)
    return tuple(out)


def _factors(adapter: Adapter, m: ModuleAdapter) -> str:
    parts = [f"{key!r} {list(adapter.ckpt.tensors[key].shape)}" for role, key in sorted(m.keys.items())
             if role != "alpha"]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def check_architecture(adapter: Adapter) -> None:
    """Refuse (exit 2, by key) the first module whose difference is not its layer's shape for the sizes the
    adapter's modules pin."""
    formula = formulas(adapter)
    got = {param: tuple(delta_shape(adapter, adapter.modules[param])) for param in formula}
    sizes = _pinned(formula, got)
    for param, dims in formula.items():
        want = _expected(dims, sizes, got[param])
        if want == got[param]:
            continue
        m = adapter.modules[param]
        shown = ", ".join(str(d) if d is not None else "?" for d in dims)
        pins = ", ".join(f"{name} = {sizes[name]}" for name in sorted(sizes)
                         if any(isinstance(d, str) and re.search(rf"\b{name}\b", d) for d in dims))
        kind = {"lokr": "LoKr", "loha": "LoHa", "lora": "LoRA"}.get(m.kind, m.kind)
        raise InputError(
            f"{adapter.path}: {kind} factors {_factors(adapter, m)} make a {list(got[param])} difference for "
            f"{param}, which the {adapter.table.name} architecture makes [{shown}]"
            + (f" = {list(want)} with the sizes most of the adapter's modules give ({pins})" if want else "")
            + ". No configuration of the model has that layer. Nothing was written.",
            hint="The adapter is damaged or made for another model; export it again, or pass --config BASE to "
                 "check it against the base it is for.")


def check_config(adapter: Adapter, config: Mapping[str, Any], where: str = "--config") -> None:
    """Refuse (exit 2, by key) the first module whose difference is not its layer's shape in the base `config`,
    or whose layer the base does not have."""
    shapes = family_for(adapter.table).expected_shapes(config, adapter.naming)
    for param, m in adapter.modules.items():
        got = tuple(delta_shape(adapter, m))
        want = shapes.get(param)
        if want is not None and tuple(want) == got:
            continue
        kind = {"lokr": "LoKr", "loha": "LoHa", "lora": "LoRA"}.get(m.kind, m.kind)
        what = (f"the base ({where}) has no {param}" if want is None else
                f"{param} is {list(want)} in the base ({where})")
        raise InputError(f"{adapter.path}: {kind} factors {_factors(adapter, m)} make a {list(got)} difference; "
                         f"{what}. Nothing was written.",
                         hint="The adapter is damaged or made for another model; export it again, or convert it "
                              "against the base it was made for.")


__all__ = ["check_architecture", "check_config", "formulas"]
