"""Carry adapter factors across a mapping table's operations, exactly, without multiplying them out.

For a weight op W' = f(W) that only moves rows (rename, row split, row concat, half swap), the adapter delta must
move the same way: f(B A). Per kind:

- LoRA: rename keeps (B, A); a split copies A and splits B by rows (B_q A is exactly the q rows of B A), then drops
  columns of B_q that are all zero with their rows of A (a kohya rank-3r qkv whose up matrix is block-diagonal
  becomes three rank-r LoRAs); a half swap swaps B's halves only (swap(B A) = swap(B) A); a concat stacks B rows
  over a shared A, or block-diagonally over stacked A's when the parts' A differ.
- LoKr kron(w1, w2): rows of the product come in blocks of w2's row count per w1 row, so a split or swap is
  exact on w1's rows when w1's row count allows it; otherwise the factors cannot be split (refused, or the delta is
  materialised when asked).
- LoHa (w1_a w1_b) * (w2_a w2_b): row moves apply to both w*_a; a concat is refused.
- diff: the op itself.

Every factor here is float32 with the module's scale (alpha / rank, strength) already folded into one factor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from porting.errors import PortError
from porting.families.mapping import MappingTable, Step
from porting.families.ops import Concat, Rename, Split, SwapHalves
from porting.inputs.adapter_keys import Adapter, ModuleAdapter

from . import delta as D


class NotSplittable(PortError):
    """Factors that no exact factors in the target naming exist for."""


@dataclass
class Factors:
    """One module's adapter in some naming, ready to write: scale folded in, float32."""

    param: str
    kind: str  # lora, lokr, loha, diff
    t: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def module(self) -> str:
        return self.param.rpartition(".")[0]

    @property
    def rank(self) -> int | None:
        return self.t["down"].shape[0] if self.kind == "lora" else None


def baked(adapter: Adapter, m: ModuleAdapter, strength: float = 1.0) -> Factors:
    """Read a module's factors in float32 and fold its scale into one of them."""
    s = D.multiplier(adapter, m, strength)
    t = {role: D.read32(adapter, m, role) for role in m.keys if role != "alpha"}
    first = {"lora": "up", "loha": "w1_a", "diff": "diff"}.get(m.kind)
    if m.kind == "lokr":
        first = "w1" if "w1" in t else "w1_a"
    if first not in t:  # a diff_b only module
        first = next(iter(t))
    t[first] = t[first] * s
    return Factors(m.param, m.kind, t)


def materialised(f: Factors) -> Factors:
    """The same module as a full difference (`diff`)."""
    t = f.t
    if f.kind == "lora":
        d = t["up"] @ t["down"]
    elif f.kind == "lokr":
        w1 = t["w1"] if "w1" in t else t["w1_a"] @ t["w1_b"]
        w2 = t["w2"] if "w2" in t else t["w2_a"] @ t["w2_b"]
        d = torch.kron(w1, w2)
    elif f.kind == "loha":
        d = (t["w1_a"] @ t["w1_b"]) * (t["w2_a"] @ t["w2_b"])
    else:
        return f
    return Factors(f.param, "diff", {"diff": d})


def as_full_rank_lora(f: Factors) -> Factors:
    """A difference written as an exact LoRA of rank min(out, in): B = I or A = I."""
    d = f.t["diff"]
    out, inp = d.shape
    if out <= inp:
        return Factors(f.param, "lora", {"up": torch.eye(out), "down": d})
    return Factors(f.param, "lora", {"up": d, "down": torch.eye(inp)})


def _rows(f: Factors) -> int:
    return _lokr_w(f, "w1")[0] if f.kind == "lokr" else 0


def _lokr_w(f: Factors, name: str) -> tuple[int, int]:
    if name in f.t:
        return tuple(f.t[name].shape)
    return (f.t[name + "_a"].shape[0], f.t[name + "_b"].shape[1])


def _row_key(f: Factors, name: str) -> str:
    """The tensor whose rows are the rows of LoKr factor `name`."""
    return name if name in f.t else name + "_a"


def _compact(up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop rank columns of `up` that are all zero (and their rows of `down`); exact. Keeps at least one."""
    used = up.abs().amax(dim=0) > 0
    if used.all() or not used.any():
        return up, down
    return up[:, used].contiguous(), down[used].contiguous()


def _refuse(f: Factors, step: Step, why: str) -> NotSplittable:
    return NotSplittable(
        f"{f.kind} on {f.param} cannot be carried to {', '.join(step.targets)}: {why}.",
        hint="Pass --materialise to write this module's delta instead (exact, full rank, large), or merge the "
             "adapter into the base with port merge.")


def split_sizes(f: Factors, op: Split, step: Step, rows: int) -> list[int]:
    if op.sizes is not None:
        return list(op.sizes)
    if rows % op.parts:
        raise _refuse(f, step, f"{rows} rows do not split into {op.parts} equal parts")
    return [rows // op.parts] * op.parts


def carry(step: Step, op, sources: list[Factors | None]) -> list[Factors | None]:
    """The factors for `step.targets` given the factors for `step.sources` (None: that source has no adapter)."""
    present = [f for f in sources if f is not None]
    if isinstance(op, Rename):
        f = sources[0]
        return [Factors(step.targets[0], f.kind, dict(f.t))] if f else [None]
    if isinstance(op, SwapHalves) and op.dim == 0:
        return [_swap(sources[0], step)]
    if isinstance(op, Split) and op.dim == 0:
        return _split(sources[0], op, step)
    if isinstance(op, Concat) and op.dim == 0:
        return [_concat(sources, present, op, step)]
    raise _refuse(present[0], step, f"the table's {op.name} op is not a row move")


def _swap(f: Factors, step: Step) -> Factors:
    t = dict(f.t)

    def swap(x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=0)
        return torch.cat([b, a], dim=0)

    if f.kind == "lora":
        t["up"] = swap(t["up"])
    elif f.kind == "loha":
        t["w1_a"], t["w2_a"] = swap(t["w1_a"]), swap(t["w2_a"])
    elif f.kind == "diff":
        t = {k: swap(v) for k, v in t.items()}
    else:
        rows1 = _rows(f)
        if rows1 % 2 == 0:
            t[_row_key(f, "w1")] = swap(t[_row_key(f, "w1")])
        elif rows1 == 1:
            t[_row_key(f, "w2")] = swap(t[_row_key(f, "w2")])
        else:
            raise _refuse(f, step, f"the Kronecker factor w1 has {rows1} rows, an odd number, so the product's halves "
                                   "are not whole factor rows")
    return Factors(step.targets[0], f.kind, t)


def _split(f: Factors, op: Split, step: Step) -> list[Factors | None]:
    if f is None:
        return [None] * op.parts
    t = f.t
    if f.kind == "lora":
        sizes = split_sizes(f, op, step, t["up"].shape[0])
        parts = []
        for name, up in zip(step.targets, torch.split(t["up"], sizes, dim=0)):
            up, down = _compact(up, t["down"])
            parts.append(Factors(name, "lora", {"up": up.contiguous(), "down": down.clone()}))
        return parts
    if f.kind == "diff":
        sizes = split_sizes(f, op, step, t["diff"].shape[0])
        return [Factors(n, "diff", {"diff": p.contiguous()}) for n, p in zip(step.targets, t["diff"].split(sizes))]
    if f.kind == "loha":
        sizes = split_sizes(f, op, step, t["w1_a"].shape[0])
        ones, twos = t["w1_a"].split(sizes), t["w2_a"].split(sizes)
        return [Factors(n, "loha", {"w1_a": a.contiguous(), "w1_b": t["w1_b"].clone(), "w2_a": b.contiguous(),
                                    "w2_b": t["w2_b"].clone()}) for n, a, b in zip(step.targets, ones, twos)]
    rows1, rows2 = _rows(f), _lokr_w(f, "w2")[0]
    sizes = split_sizes(f, op, step, rows1 * rows2)
    if any(s % rows2 for s in sizes):
        raise _refuse(f, step, f"the product's rows come in blocks of {rows2} (the Kronecker factor w2's rows) and "
                               f"the parts need {sizes} rows, so no exact q/k/v factors exist")
    key = _row_key(f, "w1")
    out = []
    for name, rows in zip(step.targets, t[key].split([s // rows2 for s in sizes])):
        part = {k: v.clone() for k, v in t.items()}
        part[key] = rows.contiguous()
        out.append(Factors(name, "lokr", part))
    return out


def _concat(sources: list[Factors | None], present: list[Factors], op: Concat, step: Step) -> Factors:
    kinds = {f.kind for f in present}
    if kinds - {"lora", "diff"} or len(kinds) > 1:
        raise _refuse(present[0], step, f"{'/'.join(sorted(kinds))} factors of separate projections cannot be "
                                        "fused into one exact factor set")
    kind = kinds.pop()
    rows_key = "up" if kind == "lora" else "diff"
    if op.sizes is not None:
        sizes = list(op.sizes)
    else:
        rows = {f.t[rows_key].shape[0] for f in present}
        if len(rows) != 1:
            raise _refuse(present[0], step, "the parts have different row counts; pass the base's config")
        sizes = [rows.pop()] * op.parts
    width = present[0].t["down" if kind == "lora" else "diff"].shape[1]
    if kind == "diff":
        blocks = [f.t["diff"] if f else torch.zeros(n, width) for f, n in zip(sources, sizes)]
        return Factors(step.targets[0], "diff", {"diff": torch.cat(blocks)})
    downs = [f.t["down"] for f in present]
    if all(torch.equal(downs[0], d) for d in downs[1:]):
        r = downs[0].shape[0]
        ups = [f.t["up"] if f else torch.zeros(n, r) for f, n in zip(sources, sizes)]
        return Factors(step.targets[0], "lora", {"up": torch.cat(ups), "down": downs[0].clone()})
    ranks = [f.t["down"].shape[0] if f else 0 for f in sources]
    up = torch.zeros(sum(sizes), sum(ranks))
    row = col = 0
    for f, n, r in zip(sources, sizes, ranks):
        if f is not None:
            up[row:row + n, col:col + r] = f.t["up"]
        row, col = row + n, col + r
    return Factors(step.targets[0], "lora", {"up": up, "down": torch.cat(downs)})


def unsized(table: MappingTable, step: Step):
    """The step's op without a model config: sizes naming one config value become equal parts.

    Returns None when the parts are unequal (only the base's config can size them).
    """
    op = step.op
    if isinstance(op, (Split, Concat)):
        names = (table.rules[step.rule_index].op or {}).get("sizes")
        if names is not None and len(set(map(str, names))) > 1:
            return None
        return type(op)(op.dim, op.parts, None)
    return op
