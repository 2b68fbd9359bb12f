"""Rendering a `port compare` result (compare.json) as the SVDQuant-style table; shared by compare and publish."""

from __future__ import annotations

from typing import Any

COMPARE_JSON = "compare.json"
COMPARE_MD = "compare.md"


def fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def summary_rows(doc: dict[str, Any]) -> list[tuple[str, dict[str, float] | None, int]]:
    s = doc["summary"]
    return [("PSNR (dB, higher is closer)", s["psnr"], 2), ("SSIM (higher is closer)", s["ssim"], 3),
            ("LPIPS (AlexNet, lower is closer)", s["lpips"], 4)]


def summary_markdown(doc: dict[str, Any], reasons: bool = True) -> list[str]:
    """The SVDQuant-style table plus the notes it needs (cap, LPIPS availability; `reasons=False` leaves out the
    local details of why LPIPS was unavailable, for a public model card)."""
    lines = ["| metric | mean | p50 | p90 |", "|---|---|---|---|"]
    for name, stats, digits in summary_rows(doc):
        if stats is None:
            lines.append(f"| {name} | unavailable | | |")
        else:
            lines.append(f"| {name} | {fmt(stats['mean'], digits)} | {fmt(stats['p50'], digits)} | "
                         f"{fmt(stats['p90'], digits)} |")
    m = doc["metrics"]
    notes = []
    if m["psnr"]["capped"]:
        notes.append(f"PSNR is capped at {m['psnr']['cap_db']:g} dB: {m['psnr']['capped']} of {len(doc['images'])} "
                     "image pair(s) are identical (infinite PSNR)")
    if not m["lpips"]["available"]:
        notes.append(f"LPIPS unavailable: {m['lpips']['reason']}" if reasons else
                     "LPIPS was not measured (its AlexNet backbone weights were not available offline)")
    return lines + ([""] + [f"- {n}." for n in notes] if notes else [])
