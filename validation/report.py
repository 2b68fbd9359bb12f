"""report.json (the contract with `port publish`), report.md and the terminal table."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rich.table import Table

from porting import charts
from porting.errors import redact
from porting.families.mapping import MappingTable
from porting.outputs import atomic_folder
from porting.reports import prepare_run_folder

REPORT_JSON = "report.json"
REPORT_MD = "report.md"


def original_name(table: MappingTable, stage: str, labels: Mapping[str, str] | None = None) -> str:
    """`transformer_blocks.3` -> `double_blocks.3`, through the mapping table's block templates; the stages that are
    not blocks (`embed`, `final`) by the family's `labels`."""
    if labels and stage in labels:
        return labels[stage]
    diff, orig = table.block_patterns("diffusers"), table.block_patterns("original")
    for placeholder, pattern in diff.items():
        m = pattern.match(stage + ".")
        if m and placeholder in orig:
            head = orig[placeholder].pattern.split("(")[0].replace("\\", "")
            return f"{head}{m.group(1)}"
    return stage


@dataclass
class Report:
    data: dict[str, Any]

    @property
    def verdict(self) -> str:
        return self.data["verdict"]

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def write(self, folder: Path, inputs: Mapping[str, Path | str | None] | None = None) -> list[Path]:
        """Write report.json and report.md as a new folder, replacing only a report folder validate wrote."""
        prepare_run_folder(folder)
        with atomic_folder(folder, verb="validate", replace="owned", inputs=inputs) as staging:
            (staging / REPORT_JSON).write_text(redact(json.dumps(_finite(self.data), indent=2)) + "\n")
            drawn = charts.write_block_chart(self.data, staging / charts.BLOCKS_PNG, short_stage)
            (staging / REPORT_MD).write_text(redact(to_markdown(self.data, chart=charts.BLOCKS_PNG if drawn else None)))
        return [folder / REPORT_JSON, folder / REPORT_MD] + ([folder / charts.BLOCKS_PNG] if drawn else [])


def _finite(obj: Any) -> Any:
    """JSON has no NaN/Infinity: write them as strings so every reader can parse the report."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def _pct(x: float) -> str:
    """A relative error in percent to three significant digits: 0.00041 % and 12.3 % both read (a fixed number of
    decimals shows a small error as 0.000 %)."""
    return f"{100 * x:.3g} %" if math.isfinite(x) else "NaN/Inf"


def _ratio(x: float) -> str:
    """Two decimals (1.00, 0.07), and two significant digits below 0.1 so a small ratio never reads 0.00."""
    if not math.isfinite(x):
        return "inf"
    return f"{x:.2f}" if abs(x) >= 0.1 or x == 0 else f"{x:.2g}"


def _pipeline_line(dist: dict[str, Any]) -> str:
    ranks = "; ".join(f"rank {r['rank']} on `{r['device']}` (golden on `{r['reference']}`): {r['stages'][0]}.."
                      f"{r['stages'][-1]}" for r in dist["ranks"])
    return (f"- pipeline over {dist['world_size']} ranks ({dist['backend']}): {ranks}; the numbers are those of a "
            "single-device run with its golden at the same place")


def to_markdown(d: dict[str, Any], chart: str | None = "") -> str:
    """report.md; `chart`: the per-block PNG next to it, None for the text chart (no matplotlib), "" for none."""
    lines = [f"# Validation report: **{d['verdict'].upper()}**", "",
             f"- model: `{d['model']['path']}` ({d['model']['variant']}, {d['model']['naming']} naming)",
             *([f"- dequantized from {d['model']['dequantized_from']} (golden: the dequantized weights in float32)"]
               if d["model"].get("dequantized_from") else []),
             f"- weights sha256: `{d['weights_sha256']}`",
             f"- device under test: `{d['device']}` in {d['dtype']}; "
             f"golden: `{d['reference']}` in {d['golden_dtype']}; "
             f"intrinsic reference ({d.get('intrinsic', 'native')}): "
             + d.get("intrinsic_run", f"`{d['reference']}` in {d['dtype']}"),
             *[f"- **note:** {n}" for n in d.get("notices") or []],
             f"- inputs: {d['inputs']['resolution']}x{d['inputs']['resolution']} ({d['inputs']['image_tokens']} image "
             f"tokens), {d['inputs']['text_tokens']} text tokens, timesteps {d['inputs']['timesteps']}, seeds "
             f"{d['inputs']['seeds']}, text features: {d['inputs']['text_features']}",
             *([_pipeline_line(d["distributed"])] if d.get("distributed") else []),
             f"- rule: {d['rule']['statement']}", ""]
    if d["reasons"]:
        lines += ["## Why it failed", ""] + [f"- {r}" for r in d["reasons"]] + [""]
    lines += ["## Final output", "", "| case | device rel-L2 | intrinsic rel-L2 | ratio | cosine (device) |",
              "|---|---|---|---|---|"]
    for row in d["summary"]:
        lines.append(f"| {row['name']} | {_pct(row['device_error'])} | {_pct(row['intrinsic_error'])} | "
                     f"{_ratio(row['ratio'])} | {row['cosine']:.6f} |")
    localisation = d.get("localisation") or {"per_block": True}
    if not localisation["per_block"]:
        lines += ["", "## Per block", "", f"Not available: {localisation['note']}."]
    else:
        quant = any("quantization" in b for b in d["blocks"])
        lines += ["", "## Per block (teacher-forced: each block fed the golden inputs)", "",
                  "| stage | original | device rel-L2 | intrinsic rel-L2 | ratio | accumulated ratio | flag |"
                  + (" 4-bit vs dequantized |" if quant else ""),
                  "|---|---|---|---|---|---|---|" + ("---|" if quant else "")]
        if quant:
            lines[-3:-3] = ["The golden runs the packed 4-bit computation in float32; the last column is that "
                            "golden against the float32 run of the dequantized weights, block by block: where the "
                            "quantization error sits.", ""]
    for b in d["blocks"]:
        tf = b["teacher_forced"]
        flag = "BLAME" if d["blame"] and d["blame"]["stage"] == b["stage"] else ("growth" if b["growth_flag"] else "")
        extra = f" {_pct(b['quantization']['rel_l2'])} |" if "quantization" in b else ""
        lines.append(f"| {b['stage']} | {b['original']} | {_pct(tf['device']['rel_l2'])} | "
                     f"{_pct(tf['intrinsic']['rel_l2'])} | {_ratio(tf['ratio'])} | "
                     f"{_ratio(b['accumulated']['ratio'])} | {flag} |{extra}")
    if d["blocks"] and chart != "":
        lines += ["", "## Per-block error against the budget", ""]
        lines += charts.markdown(chart, f"per-block error against the {d['dtype']} budget",
                                 charts.block_text_chart(d, short_stage))
    if d.get("known_differences"):
        lines += ["", "## Known, expected differences", ""] + [f"- {x}" for x in d["known_differences"]]
    lines += ["", "Relative L2 e and cosine relate as cosine = 1/sqrt(1+e^2): e = 1 % is cosine 0.99995, "
              "e = 14 % is cosine 0.99.", ""]
    return "\n".join(lines)


_SHORT = {"transformer_blocks": "double", "single_transformer_blocks": "single"}


def short_stage(stage: str) -> str:
    """`transformer_blocks.3` -> `double 3`, `single_transformer_blocks.17` -> `single 17` (the terminal table's
    names; report.json and report.md keep the full ones)."""
    head, _, index = stage.rpartition(".")
    return f"{_SHORT[head]} {index}" if head in _SHORT and index.isdigit() else stage


def terminal_table(d: dict[str, Any], max_rows: int = 80) -> Table:
    """The per-block table at 80 columns: short stage names, no original names (report.md and --json carry both),
    and a flag column only when some row is flagged."""
    intrinsic = "intrinsic " + ("emu." if d.get("intrinsic") == "emulated" else "err")
    # short enough for the table's own width (rich wraps a title to it, which split the longer one mid-phrase)
    table = Table(title=f"{d['verdict'].upper()}: {d['device']} {d['dtype']} vs golden {d['reference']} "
                        f"{d['golden_dtype']}, limit ratio {d['rule']['max_ratio']}")
    blame = d["blame"]["stage"] if d["blame"] else None
    blocks = d["blocks"][:max_rows]
    flags = ["BLAME" if b["stage"] == blame else ("growth" if b["growth_flag"] else "") for b in blocks]
    flagged = any(flags)
    quant = any("quantization" in b for b in blocks)
    for col in ("stage", "device err", intrinsic, "ratio", "acc. ratio") + (("4-bit",) if quant else ()) \
            + (("flag",) if flagged else ()):
        table.add_column(col, no_wrap=True)
    for b, flag in zip(blocks, flags):
        tf = b["teacher_forced"]
        table.add_row(short_stage(b["stage"]), _pct(tf["device"]["rel_l2"]), _pct(tf["intrinsic"]["rel_l2"]),
                      _ratio(tf["ratio"]), _ratio(b["accumulated"]["ratio"]),
                      *((_pct(b["quantization"]["rel_l2"]) if "quantization" in b else "",) if quant else ()),
                      *((flag,) if flagged else ()))
    for row in d["summary"]:
        name = "output" if row["name"] == "all cases" else row["name"].replace("seed ", "s").replace(", ", " ")
        table.add_row(name, _pct(row["device_error"]), _pct(row["intrinsic_error"]), _ratio(row["ratio"]), "",
                      *(("",) if quant else ()), *(("",) if flagged else ()))
    localisation = d.get("localisation") or {"per_block": True}
    if not localisation["per_block"]:
        table.caption = f"no per-block rows: {localisation['note']}"
    elif len(d["blocks"]) > max_rows:
        table.caption = f"{len(d['blocks']) - max_rows} more block(s) in report.md"
    return table
