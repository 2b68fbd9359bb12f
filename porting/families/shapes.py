"""A diffusers model's keys and shapes as data: templates whose dims are written in the family's sizes.

The data is generated from diffusers itself (`python -m porting.families shapes FAMILY`, generate_shapes.py) and
checked against the meta-device model for several configs by the tests; it lets a conversion plan strictly without
importing diffusers. A dim is an integer or a sum of `k*size` terms (`3*inner_dim+2*mlp_hidden`); a key template
holds the table's block placeholders (`transformer_blocks.{d}.attn.to_q.weight`) and may depend on a config flag.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import tomllib

FORMAT_VERSION = 1
Shape = tuple[int, ...]
TERM = re.compile(r"^(?:(\d+)\*)?([A-Za-z_]\w*)$")


def evaluate(expr: str | int, sizes: Mapping[str, Any]) -> int:
    if isinstance(expr, int):
        return expr
    total = 0
    for term in expr.split("+"):
        term = term.strip()
        if term.isdigit():
            total += int(term)
            continue
        m = TERM.match(term)
        if not m or m.group(2) not in sizes:
            raise ValueError(f"shape term {term!r} names no known size")
        total += int(m.group(1) or 1) * int(sizes[m.group(2)])
    return total


@dataclass(frozen=True)
class ShapeTemplate:
    family: str
    generated_from: str
    entries: tuple[tuple[str, tuple[str | int, ...], str | None], ...]  # key template, dims, when-flag

    def expand(self, sizes: Mapping[str, Any], blocks: Mapping[str, str]) -> dict[str, Shape]:
        out: dict[str, Shape] = {}
        for key, dims, when in self.entries:
            if when and not sizes.get(when):
                continue
            shape = tuple(evaluate(d, sizes) for d in dims)
            names = [p for p in blocks if "{" + p + "}" in key]
            for values in itertools.product(*(range(int(sizes[blocks[p]])) for p in names)):
                out[key.format(**dict(zip(names, values)))] = shape
        return out


def load_template(text: str, where: Path | str) -> ShapeTemplate:
    data = tomllib.loads(text)
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{where}: shape data format_version {data.get('format_version')!r}, "
                         f"expected {FORMAT_VERSION}")
    entries = tuple((e["key"], tuple(e["shape"]), e.get("when")) for e in data["tensor"])
    return ShapeTemplate(data["family"], data.get("generated_from", ""), entries)
