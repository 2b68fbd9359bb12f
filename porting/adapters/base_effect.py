"""`port inspect ADAPTER --base BASE`: each module's effect on the base (effect.py), the base read a tensor at a time.

Where each key lands is decided exactly as `port merge` decides it (`Placement`, from headers); each landed delta
is computed in float32 by `delta.delta` (through the table's op when the adapter and base namings differ), and the
base tensor it lands on is read alone, measured, and dropped before the next one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from porting.finite import check_number, check_tensor

from .delta import delta
from .effect import Effect
from .merge import Placement

if TYPE_CHECKING:
    from porting.inputs import SourceLike


def effect_on_base(adapter_src: SourceLike, base_src: SourceLike, strength: float = 1.0) -> dict[str, Any]:
    """The `Effect` document of one adapter at `strength` on a base (a file or folder, any naming); each is a path
    or its opened `Source`."""
    from porting.inputs import as_source, shown

    check_number(float(strength), "strength", shown(adapter_src))
    base_source = as_source(base_src, kind="weights")
    base = shown(base_src)
    detection = base_source.detection
    ckpt = detection.ckpt
    adapter = as_source(adapter_src, kind="adapter").read_adapter(prefer=detection.table.name)
    placement = Placement(ckpt, detection, [(adapter, float(strength))])
    effect = Effect(strength=float(strength))
    effect.land_nowhere(placement.leftovers)
    params = sorted({*placement.direct, *placement.via})
    for param in params:
        names = placement.names(param)
        d = None
        for a, m, s in placement.direct.pop(param, []):
            part = delta(a, m, s)
            d = part if d is None else d.add_(part)
        if param in placement.via:
            part = placement.via.pop(param).compute().pop(param)
            d = part if d is None else d.add_(part)
        assert d is not None
        weight = ckpt.read(detection.prefix + param)
        # a NaN / Inf in the base makes every norm meaningless: refused by name, never reported as `ok`
        check_tensor(weight, f"base tensor {detection.prefix + param!r}", base,
                     hint="The base is damaged; the adapter's effect on it cannot be measured (and merging into it "
                          "would be refused too).")
        effect.observe(param, weight, delta=d, adapters=names)
        del d
    effect.doc["base"] = str(base)
    effect.doc["base_variant"] = detection.variant
    return effect.doc
