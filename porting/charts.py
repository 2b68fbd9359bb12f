"""Charts next to the reports: validate's per-block errors against the bf16 budget, bench's memory and time per
offload mode.

matplotlib is the `charts` extra. Without it no PNG is written: the report carries a text chart instead and a line
naming the extra (`MISSING`), so a reader knows what is missing and how to get it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Sequence

BLOCKS_PNG = "blocks.png"
BENCH_PNG = "bench.png"
BAR = 40  # columns of the text chart's longest bar


def missing() -> str | None:
    """Why no PNG chart can be drawn (naming the extra), or None when matplotlib imports."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed, so no PNG chart was drawn (pip install 'flux-port[charts]')"
    return None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def block_points(report: dict[str, Any], name: Callable[[str], str] = str) -> list[tuple[str, float, float]]:
    """(name(stage), device error, budget) per block, teacher-forced; the budget is max_ratio x the error the ratio
    was taken against (bf16's own, floored as the verdict floors it)."""
    from_report = report.get("blocks") or []
    limit = float(report["rule"]["max_ratio"])
    points = []
    for b in from_report:
        tf = b["teacher_forced"]
        device, ratio = float(tf["device"]["rel_l2"]), float(tf["ratio"])
        against = device / ratio if ratio > 0 and math.isfinite(ratio) else float(tf["intrinsic"]["rel_l2"])
        points.append((name(b["stage"]), device, limit * against))
    return points


def write_block_chart(report: dict[str, Any], path: Path, name: Callable[[str], str] = str) -> bool:
    """Draw the per-block chart as a PNG at `path`; False (nothing written) without matplotlib or blocks."""
    points = block_points(report, name)
    if not points or missing():
        return False
    plt = _pyplot()
    names, errors, budgets = zip(*points)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(points) + 2), 4.0), dpi=100)
    x = range(len(points))
    colours = ["#c0392b" if e > b else "#2e86c1" for e, b in zip(errors, budgets)]
    ax.bar(x, errors, color=colours, label=f"{report['device']} {report['dtype']} error (teacher-forced)")
    ax.step(x, budgets, where="mid", color="black", linewidth=1.2,
            label=f"budget: {report['rule']['max_ratio']} x {report['dtype']}'s own error")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names, rotation=90, fontsize=7)
    ax.set_ylabel("relative L2 against the golden")
    ax.set_title(f"Per-block error against the {report['dtype']} budget: {report['verdict'].upper()}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True


def text_bars(rows: Sequence[tuple[str, float]], limit: float, unit: str) -> list[str]:
    """A text bar chart: one line per row, bars scaled so `limit` (or the largest value) spans BAR columns."""
    top = max([limit, *(v for _, v in rows if math.isfinite(v))] or [1.0]) or 1.0
    width = max((len(n) for n, _ in rows), default=0)
    return [f"{n:<{width}} {'#' * round(BAR * min(v, top) / top) if math.isfinite(v) else '!' * BAR:<{BAR}} "
            f"{v:.3g}{unit}" for n, v in rows]


def block_text_chart(report: dict[str, Any], name: Callable[[str], str] = str) -> list[str]:
    """The per-block chart as text: each block's error as a share of its budget (1.0 = the limit)."""
    return text_bars([(n, e / b if b > 0 else math.inf) for n, e, b in block_points(report, name)], 1.0,
                     " of budget")


def write_bench_chart(doc: dict[str, Any], path: Path) -> bool:
    """Peak memory and s/image per offload mode (and task) as a PNG at `path`; False without matplotlib or rows."""
    rows = [r for r in doc["rows"] if r["status"] == "ok"]
    if not rows or missing():
        return False
    plt = _pyplot()
    import textwrap

    # a model card row's name ("4-bit transformer + text encoder") wrapped to the bar's width
    labels = ["\n".join(x for x in (textwrap.fill(r.get("model") or "", 14), r["mode"], r["task"]) if x)
              for r in rows]
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(max(6.0, 1.2 * len(rows) + 3), 3.6), dpi=100)
    mem.bar(labels, [r["memory"]["peak_bytes"] / 2**30 for r in rows], color="#2e86c1")
    mem.set_ylabel(f"peak memory, GiB ({doc['memory_counter']})", fontsize=7)
    mem.set_title("peak memory")
    speed.bar(labels, [r["s_per_image"] for r in rows], color="#27ae60")
    speed.set_ylabel("seconds per image")
    speed.set_title(f"{doc['settings']['width']}x{doc['settings']['height']}, {doc['settings']['steps']} step(s)")
    for ax in (mem, speed):
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"port bench: {doc['pipeline']} on {doc['device']} ({doc['dtype']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
    return True


def bench_text_chart(doc: dict[str, Any]) -> list[str]:
    rows = [r for r in doc["rows"] if r["status"] == "ok"]
    names = [" ".join(x for x in (r.get("model"), r["mode"], r["task"]) if x) for r in rows]
    mem = text_bars([(n, r["memory"]["peak_bytes"] / 2**30) for n, r in zip(names, rows)], 0, " GiB")
    speed = text_bars([(n, r["s_per_image"]) for n, r in zip(names, rows)], 0, " s/image")
    return ["peak memory", *mem, "", "seconds per image", *speed]


def markdown(png: str | None, alt: str, text: list[str]) -> list[str]:
    """The chart's lines in a report.md: the PNG when drawn, else the text chart and why there is no PNG."""
    if png:
        return [f"![{alt}]({png})", ""]
    if not text:
        return []
    return [f"Chart: {missing() or 'no PNG chart was drawn'}; the text form:", "", "```", *text, "```", ""]
