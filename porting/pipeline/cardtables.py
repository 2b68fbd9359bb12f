"""The measured tables of a model card: the latest `port compare` and `port bench` results for the same weights.

compare and bench write into reports/compare/<time>/ and reports/bench/<time>/ next to what they ran (the workspace
layout: <recipe>/reports/), each recording the sha256 of the transformer weights that ran. publish looks there,
keeps the documents whose weights are the ones it publishes, and renders the newest of each kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from porting._files import parse_json
from porting.errors import InputError
from porting.text import markdown_code as _code
from porting.text import markdown_text as _md

from .bench import BENCH_JSON, table_markdown
from .compare_tables import COMPARE_JSON, summary_markdown

MAX_DEPTH = 3  # reports/compare/<time>/compare.json


def report_roots(transformer: Path) -> list[Path]:
    """Where compare and bench write by default for this transformer (or a folder published from it)."""
    return [transformer.resolve().parent / "reports"]


def _candidates(roots: Iterable[Path], name: str) -> Iterable[Path]:
    for root in roots:
        if root.is_dir():
            for depth in range(MAX_DEPTH + 1):
                yield from root.glob("/".join(["*"] * depth + [name]))


def latest(roots: Iterable[Path], name: str, weights: str, weights_of: str) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable document called `name` under `roots` whose `weights_of` side ran `weights`."""
    best: tuple[str, Path, dict[str, Any]] | None = None
    for path in _candidates(roots, name):
        try:
            doc = parse_json(path.read_bytes(), str(path), kind=dict)
        except (OSError, InputError):
            continue
        side = doc.get(weights_of) if weights_of else doc
        if not isinstance(side, dict) or side.get("weights_sha256") != weights:
            continue
        created = str(doc.get("created", ""))
        if best is None or created > best[0]:
            best = (created, path, doc)
    return (best[1], best[2]) if best else None


def _escaped(value: Any) -> Any:
    """A compare / bench document with every text value escaped for markdown (numbers kept): the documents are
    inputs, and no text in them may become markup, a link or HTML in the card."""
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return _md(value) if isinstance(value, str) else value


def card_markdown(weights: str, roots: Iterable[Path]) -> str:
    """The sections as text to append to a model card ending in a newline; empty when nothing was measured."""
    lines = card_sections(weights, roots)
    return "\n" + "\n".join(lines) if lines else ""


def _where(side: dict[str, Any]) -> str:
    """`parent/name` of a side's transformer, for a code span."""
    transformer = Path(str(side["transformer"]))
    return _code(f"{transformer.parent.name}/{transformer.name}")


def card_sections(weights: str, roots: Iterable[Path]) -> list[str]:
    """Markdown lines for the model card (nothing when no measurement of these weights exists)."""
    roots = list(roots)
    lines: list[str] = []
    found = latest(roots, COMPARE_JSON, weights, "candidate")
    if found:
        path, raw = found
        where = _where(raw["reference"])
        doc = _escaped(raw)
        ref, cand, st = doc["reference"], doc["candidate"], doc["settings"]
        lines += ["## Image quality against the reference", "",
                  f"`port compare` on {doc.get('created', 'an unknown date')}: {len(doc['images'])} prompt(s), "
                  f"{st['width']}x{st['height']}, {st['steps']} step(s), the same noise and text-encoder output on "
                  f"both sides. Reference: `{where}` (weights {ref['weights_sha256'][:12]}...) on "
                  f"{ref['device']} in {ref['dtype']}; this port on {cand['device']} in {cand['dtype']}.", "",
                  *summary_markdown(doc, reasons=False), ""]
    found = latest(roots, BENCH_JSON, weights, "")
    if found:
        path, raw = found
        device = _code(raw["device"])
        doc = _escaped(raw)
        st = doc["settings"]
        lines += ["## Speed and memory", "",
                  f"`port bench` on {doc.get('created', 'an unknown date')}: `{device}` ({doc['device_name']})"
                  f", {doc['dtype']}, {st['width']}x{st['height']}, {st['steps']} step(s), median of {st['runs']} "
                  f"run(s) after {st['warmup']} warm-up; memory counter: {doc['memory_counter']}.", "",
                  *table_markdown(doc), ""]
    return lines
