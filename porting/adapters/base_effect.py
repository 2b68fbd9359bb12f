"""`port inspect ADAPTER --base BASE`: each module's effect on the base (effect.py), the base read a tensor at a time.

Where each key lands is decided exactly as `port merge` decides it (`Placement`, from headers); each landed delta
is computed in float32 by `delta.delta` (through the table's op when the adapter and base namings differ), and the
base tensor it lands on is read alone, measured, and dropped before the next one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from porting.engine.detect import detect
from porting.finite import check_number
from porting.tensors.checkpoint import open_checkpoint

from .delta import delta
from .effect import Effect
from .merge import Placement
from .naming import read_adapter


def effect_on_base(adapter_path: str | Path, base: str | Path, strength: float = 1.0) -> dict[str, Any]:
    """The `Effect` document of one adapter at `strength` on `base` (a file or folder, any naming)."""
    check_number(float(strength), "strength", adapter_path)
    detection = detect(open_checkpoint(base))
    ckpt = detection.ckpt
    adapter = read_adapter(adapter_path, prefer=detection.table.name)
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
        effect.observe(param, ckpt.read(detection.prefix + param), delta=d, adapters=names)
        del d
    effect.doc["base"] = str(base)
    effect.doc["base_variant"] = detection.variant
    return effect.doc
