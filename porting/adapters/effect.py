"""What an adapter does to a base, module by module: how large its delta is, and whether it survives bf16.

For every base tensor an adapter lands on, with W the base weight and d the delta in float32 (at its strength;
several adapters' deltas summed, as merge adds them):

- `rel_norm` = ||d||_F / ||W||_F and `max_abs` = max |d|;
- `changed`: how many elements of the weight, stored in bf16, differ once d is added:
  round_bf16(W + d) != round_bf16(W) as bit patterns, with W + d in float32 and round-to-nearest-even (what
  `port merge` writes into a bf16 base, and what a bf16 runtime computes when it patches the weight).

A module is flagged
- `zero` when d is exactly zero (an untrained LoRA's up matrix, a LoKr factor of zeros);
- `no effect` when d is not zero but changes no element: at every element |d| is below half a bf16 ulp of the
  weight there (a tie rounds to even; just below a power of two the ulp halves, which the exact rounding handles),
  so the merged bf16 weight is the base weight bit for bit. The LoRA "loads but does nothing".
bf16 is the yardstick whatever the base's own dtype: FLUX checkpoints are published and run in bf16, so an fp32 or
dequantized base that would keep such a delta loses it in a bf16 runtime all the same.

`Effect` accumulates one row per module (`observe`), reading the weight a block of rows at a time, so no second
full-size float32 buffer is made; `doc` is the JSON summary and is updated in place, which lets merge put it in its
manifest before the tensors are read.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch

OK, ZERO, NO_EFFECT = "ok", "zero", "no effect"
BLOCK = 1 << 22  # elements per block of rows (16 MiB of float32)
DEFINITION = ("no effect: round_bf16(W + d) == round_bf16(W) at every element (|d| below half a bf16 ulp of the "
              "weight everywhere), d not zero; zero: d == 0")


def measure(weight: torch.Tensor, merged: torch.Tensor | None = None,
            delta: torch.Tensor | None = None) -> dict[str, Any]:
    """The numbers of one module: `weight` as stored, and either `merged` (W + d, float32) or `delta` (d)."""
    import numpy as np
    import torch

    if (merged is None) == (delta is None):
        raise ValueError("measure needs exactly one of merged and delta")
    other = merged if merged is not None else delta
    assert other is not None
    cols = weight.shape[-1] if weight.dim() > 1 else max(weight.numel(), 1)
    w2, o2 = weight.reshape(-1, cols), other.reshape(-1, cols)
    step = max(1, BLOCK // cols)
    size = min(step, w2.shape[0]) * cols
    f32, b16 = torch.empty(size, dtype=torch.float32), torch.empty(size, dtype=torch.bfloat16)
    w16 = torch.empty(size if weight.dtype != torch.bfloat16 else 0, dtype=torch.bfloat16)
    d_sq = w_sq = peak = 0.0
    changed = 0
    # a few in-place passes over one block, in reused buffers: about the cost of one more cast of the tensor
    for a in range(0, w2.shape[0], step):
        w, o = w2[a:a + step], o2[a:a + step]
        x, y = f32[: w.numel()].view(w.shape), b16[: w.numel()].view(w.shape)
        x.copy_(w)
        w_sq += squares(x)
        if merged is not None:
            d = x.sub_(o)  # W - (W + d): the delta's negative, same norm and largest magnitude
            y.copy_(o)
        else:
            d = o
            y.copy_(x.add_(o))
        d_sq += squares(d)
        lo, hi = torch.aminmax(d)  # several times faster than an inf-norm here
        peak = max(peak, -float(lo), float(hi))
        ref = w if weight.dtype == torch.bfloat16 else w16[: w.numel()].view(w.shape).copy_(w)
        # bit patterns compared and counted by numpy: several times faster than torch's count_nonzero here
        changed += int(np.count_nonzero(y.view(torch.int16).numpy() != ref.view(torch.int16).numpy()))
    return _status(d_sq, w_sq, peak, changed, weight.numel())


def squares(t: torch.Tensor) -> float:
    """The sum of squares of a float32 tensor; in float64 where float32 overflows (|values| above ~1.8e19), so a
    huge but finite delta gets its true norm, not an infinity."""
    import torch

    flat = t.reshape(-1)
    total = float(torch.dot(flat, flat))
    if total == float("inf"):
        wide = flat.double()
        total = float(torch.dot(wide, wide))
    return total


def _status(d_sq: float, w_sq: float, peak: float, changed: int, elements: int) -> dict[str, Any]:
    w_norm = w_sq ** 0.5
    status = ZERO if peak == 0.0 else NO_EFFECT if changed == 0 else OK
    return {"rel_norm": (d_sq ** 0.5 / w_norm) if w_norm > 0 else None, "max_abs": peak,
            "weight_norm": w_norm, "changed": changed, "elements": elements, "status": status}


def effect_of(d: torch.Tensor, d_sq: float | None = None) -> tuple[float, float, float]:
    """(||d||_F^2, min d, max d) of a block of the float32 delta; `d_sq` where the caller has it already (a LoRA's
    from its factors)."""
    import torch

    flat = d.reshape(-1)
    lo, hi = torch.aminmax(flat)  # several times faster than an inf-norm here
    return (squares(flat) if d_sq is None else d_sq), float(lo), float(hi)


def changed_bf16(before: torch.Tensor, after: torch.Tensor, total: torch.Tensor) -> int:
    """How many elements of a block change in bf16: the block as stored (`before`) against it as written (`after`,
    the float32 sum `total` rounded to the base's dtype)."""
    import numpy as np
    import torch

    if after.dtype != torch.bfloat16:  # bf16 is the yardstick whatever the base's dtype
        before, after = before.to(torch.bfloat16), total.to(torch.bfloat16)
    # bit patterns compared and counted by numpy: several times faster than torch's count_nonzero here
    return int(np.count_nonzero(after.view(torch.int16).numpy() != before.view(torch.int16).numpy()))


class BlockMeasure:
    """`measure` of one base tensor fed a block of rows at a time, from several threads (merge's block path, which
    hands over the numbers its arithmetic has at hand: see `effect_of`, `squares`, `changed_bf16`). The row it keeps
    current is the one `Effect.rows` holds."""

    def __init__(self, row: dict[str, Any], effect: Effect) -> None:
        self.row, self.effect = row, effect
        self.sums = {"d_sq": 0.0, "w_sq": 0.0, "peak": 0.0, "changed": 0}

    def block(self, d_sq: float, w_sq: float, peak: float, changed: int) -> None:
        """One block's numbers: the squared norms of its float32 delta and weight, its largest |delta| and how many
        of its bf16 elements change."""
        with self.effect.lock:  # one lock for every row: the counts are kept current with them
            s = self.sums
            s["d_sq"] += d_sq
            s["w_sq"] += w_sq
            s["peak"] = max(s["peak"], peak)
            s["changed"] += changed
            was = self.row["status"]
            self.row.update(_status(s["d_sq"], s["w_sq"], s["peak"], s["changed"], self.row["elements"]))
            self.effect._moved(was, self.row["status"])


class Effect:
    """Rows of `measure`, one per base tensor, and the keys that landed nowhere; `doc` is kept current."""

    def __init__(self, strength: float | None = None) -> None:
        self.lock = threading.Lock()
        self.rows: list[dict[str, Any]] = []
        self.unplaced: list[dict[str, str]] = []
        self.doc: dict[str, Any] = {"definition": DEFINITION, "reference_dtype": "bf16", "modules": self.rows,
                                    "unplaced": self.unplaced, "counts": {}}
        if strength is not None:
            self.doc["strength"] = strength
        self._count()

    def observe(self, module: str, weight: torch.Tensor, merged: torch.Tensor | None = None,
                delta: torch.Tensor | None = None, adapters: str = "") -> dict[str, Any]:
        """Measure one base tensor (see `measure`); `adapters` names what landed on it, for messages."""
        row = {"module": module, **measure(weight, merged, delta)}
        if adapters:
            row["adapters"] = adapters
        with self.lock:
            self.rows.append(row)
            self._count()
        return row

    def blockwise(self, module: str, elements: int, adapters: str = "") -> BlockMeasure:
        """A row for one base tensor measured block by block (`BlockMeasure.add`); zero until its blocks come."""
        row: dict[str, Any] = {"module": module, **_status(0.0, 0.0, 0.0, 0, elements)}
        if adapters:
            row["adapters"] = adapters
        with self.lock:
            self.rows.append(row)
            self._count()
        return BlockMeasure(row, self)

    def land_nowhere(self, leftovers: Iterable[tuple[str, str]]) -> None:
        """Adapter keys that land on no base tensor (or on one of another shape), with why."""
        with self.lock:
            self.unplaced += [{"keys": k, "why": why} for k, why in leftovers]
            self._count()

    def _moved(self, was: str, now: str) -> None:
        """A row's status changed (under the lock): the counts follow without a pass over every row."""
        if was != now:
            counts = self.doc["counts"]
            counts[was] -= 1
            counts[now] += 1

    def _count(self) -> None:
        counts = {"modules": len(self.rows), OK: 0, NO_EFFECT: 0, ZERO: 0, "unplaced": len(self.unplaced)}
        for row in self.rows:
            counts[row["status"]] += 1
        self.doc["counts"] = counts

    @property
    def flagged(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] != OK]

    def weakest(self, n: int = 5) -> list[dict[str, Any]]:
        """The `n` modules whose delta is smallest relative to their weight (the first to fall below bf16)."""
        ranked = sorted(self.rows, key=lambda r: (r["rel_norm"] is None, r["rel_norm"] or 0.0))
        return ranked[:n]


def summary_lines(doc: dict[str, Any], flagged: int = 10, weakest: int = 3) -> list[str]:
    """A short text summary of an `Effect.doc`: counts, the flagged modules, the weakest others."""
    c = doc["counts"]
    lines = [f"adapter effect on the base (bf16 yardstick): {c['modules']} module(s): {c[OK]} change the weight, "
             f"{c[NO_EFFECT]} no effect, {c[ZERO]} zero" + (f"; {c['unplaced']} key group(s) land nowhere"
                                                              if c["unplaced"] else "")]
    rows = doc["modules"]
    bad = [r for r in rows if r["status"] != OK]
    for r in bad[:flagged]:
        lines.append(f"  {r['status']}: {r['module']} ({_row(r)})")
    if len(bad) > flagged:
        lines.append(f"  ... and {len(bad) - flagged} more flagged (--json for every module)")
    good = sorted((r for r in rows if r["status"] == OK and r["rel_norm"] is not None), key=lambda r: r["rel_norm"])
    for r in good[:weakest]:
        lines.append(f"  weakest: {r['module']} ({_row(r)})")
    for u in doc["unplaced"][:flagged]:
        lines.append(f"  lands nowhere: {u['keys']}: {u['why']}")
    return lines


def _row(r: dict[str, Any]) -> str:
    rel = "n/a" if r["rel_norm"] is None else f"{r['rel_norm']:.3g}"
    return (f"|d|/|W| {rel}, max |d| {r['max_abs']:.3g}, changes {r['changed']:,} of {r['elements']:,} bf16 "
            "elements")
