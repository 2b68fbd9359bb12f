"""`port publish`'s model card: the README.md of a published folder, every value read from an input escaped."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from porting import __version__
from porting._files import parse_json
from porting.charts import BLOCKS_PNG
from porting.errors import InputError, UsageError, holds_secret
from porting.paths import check_within, link_roots
from porting.text import markdown_code as _code
from porting.text import markdown_text as _md

from .publish_gate import Gate
from .publish_inputs import variant_spec


def base_card_metadata(base: Path) -> dict[str, str]:
    """license / license_name / license_link from the YAML header of the base's README.md, if any."""
    readme = base / "README.md"
    if not readme.is_file():
        return {}
    check_within(readme, link_roots(base))  # its licence fields are published in the card
    lines = readme.read_text(errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return {}
    out: dict[str, str] = {}
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, sep, value = line.partition(":")
        if sep and key in ("license", "license_name", "license_link") and value.strip():
            out[key] = value.strip().strip("'\"")
    return out


FETCH_MANIFEST = "fetch-manifest.json"  # written by port fetch next to what it downloaded


def source_sha256(convert_manifest: dict[str, Any]) -> str | None:
    """sha256 of the file convert read: recorded by convert, or by port fetch in the folder it downloaded to."""
    if convert_manifest.get("source_sha256"):
        return str(convert_manifest["source_sha256"])
    if not convert_manifest.get("source"):
        return None
    source = Path(str(convert_manifest["source"]))
    for folder in list(source.parents)[:3]:
        try:
            doc = parse_json((folder / FETCH_MANIFEST).read_bytes(), str(folder / FETCH_MANIFEST))
        except (OSError, InputError):
            continue
        rel = source.relative_to(folder).as_posix()
        for record in doc.get("files", []) if isinstance(doc, dict) else []:
            if isinstance(record, dict) and record.get("path") == rel and record.get("sha256"):
                return str(record["sha256"])
    return None


def _fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return "n/a" if value is None else str(value)


REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def check_base_model(value: str) -> str:
    """--base-model is a Hub repo id (ORG/NAME) or a plain name; anything else would be injected into the card,
    and so would a credential (shown as ***)."""
    if holds_secret(value):
        raise UsageError(f"--base-model {value!r} holds a credential; the model card would publish it.",
                         hint="Give the base's Hub repo id, e.g. black-forest-labs/FLUX.2-klein-4B.")
    if REPO_ID.match(value) or re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$", value):
        return value
    raise UsageError(f"--base-model {value!r}: expected a Hub repo id such as black-forest-labs/FLUX.2-klein-4B.",
                     hint="Letters, digits, '.', '_' and '-' only, one '/' between organisation and name.")


def model_card(*, name: str, base_model: str | None, base: Path, variant: str, weights: str, gate: Gate,
               skip_validation: bool, convert_manifest: dict[str, Any]) -> str:
    """The README.md of a published folder. Without `base_model` (a Hub repo id) the YAML header names no base
    (the Hub links `base_model` to a repository; a local folder name would be a broken link)."""
    _, spec = variant_spec(variant)
    plural = "s" if len(spec.text_encoders) > 1 else ""
    meta: dict[str, str] = ({"base_model": base_model, "base_model_relation": "finetune"} if base_model else {})
    meta.update({"library_name": "diffusers", "pipeline_tag": "text-to-image", **base_card_metadata(base)})
    lines = ["---"] + [f"{k}: {json.dumps(v)}" for k, v in meta.items()]
    family, _ = variant_spec(variant)
    if base_model is None:
        base_link = f"the base in `{_code(base.resolve().name)}`"
    else:
        base_link = (f"[{base_model}](https://huggingface.co/{base_model})" if REPO_ID.match(base_model)
                     else f"`{_code(base_model)}`")
    lines += ["tags:", "  - flux-port", f"  - {family.name}", "---", "", f"# {_md(name)}", "",
              f"A {spec.title} fine-tune of {base_link} in diffusers layout, "
              f"ported by flux-port {__version__}. The base repository provides the scheduler, text "
              f"encoder{plural}, tokenizer{plural} "
              "and VAE; the transformer is the converted fine-tune.", ""]
    if not gate.passed:
        lines += ["> **Not validated.** This folder was published with `--skip-validation`: "
                  f"{_md(gate.message)}. Nothing checked that these weights compute what the original checkpoint "
                  "computes. Treat its outputs with care.", ""]
    lines += ["## Use", "", "```python", "import torch", f"from diffusers import {spec.pipeline}", "",
              f'pipe = {spec.pipeline}.from_pretrained({json.dumps(name)}, dtype=torch.bfloat16)',
              'image = pipe(prompt="a red fox in the snow").images[0]', "```", "",
              f'or `{_code(f"port generate {shlex.quote(name)}")} --prompt "a red fox in the snow" --device cuda '
              '--output fox.png`.', "",
              "## How it was converted", "", "| | |", "|---|---|"]
    source_hash = source_sha256(convert_manifest)
    rows = [("source file", Path(str(convert_manifest.get("source", "not recorded"))).name),
            ("source sha256", source_hash or "not recorded"),
            ("source naming", convert_manifest.get("source_naming", "not recorded")),
            ("mapping table", convert_manifest.get("table", "not recorded")),
            ("detected variant", convert_manifest.get("variant") or "unnamed"),
            *([("dequantized from", convert_manifest["dequantized_from"])]
              if convert_manifest.get("dequantized_from") else []),
            ("transformer weights sha256", weights),
            ("converted with", f"flux-port {convert_manifest.get('version', 'unknown')}"),
            ("published with", f"flux-port {__version__}, pipeline {spec.pipeline}")]
    lines += [f"| {k} | `{_code(v)}` |" for k, v in rows] + [""]
    lines += validation_section(gate, skip_validation)
    lines += ["## Files", "", "`manifest.json` lists the sha256 of every file; `report.json` and `report.md` are the "
              "validation report as `port validate` wrote it.", ""]
    return "\n".join(lines)


def _text(value: Any, digits: int = 4) -> str:
    """A value read from report.json for the card's prose and tables: numbers formatted, text escaped."""
    return _fmt(value, digits) if isinstance(value, (int, float)) or value is None else _md(value)


def validation_section(gate: Gate, skip_validation: bool) -> list[str]:
    """The card's validation section. Every value read from report.json is escaped (`_text` for prose and table
    cells, `_code` inside code spans): a report is an input, and its text must not become markup in the card."""
    lines = ["## Validation", ""]
    r = gate.report
    if not gate.passed:
        lines += [f"Not validated: {_md(gate.message)}." + (" Published with `--skip-validation`."
                                                             if skip_validation else ""), ""]
        if r is None:
            return lines
    rule = r.get("rule") if isinstance(r.get("rule"), dict) else {}
    statement = (_md(rule["statement"]) if rule.get("statement") else
                 f"pass when the device error is at most {_text(rule.get('max_ratio'))} x the dtype's intrinsic error")
    lines += [f"Verdict **{_text(r.get('verdict'))}**: full-model forward on `{_code(r.get('device'))}` in "
              f"`{_code(r.get('dtype'))}` against a `{_code(r.get('golden_dtype'))}` golden on "
              f"`{_code(r.get('reference'))}` (report by {_text(r.get('tool', 'flux-port'))} "
              f"{_text(r.get('version', ''))}). Rule: {statement}.", ""]
    summary = r.get("summary") if isinstance(r.get("summary"), list) else []
    summary = [row for row in summary if isinstance(row, dict)]
    if summary:
        lines += ["| output | device error | intrinsic error | ratio |", "|---|---|---|---|"]
        lines += [f"| {_text(row.get('name'))} | {_text(row.get('device_error'))} | "
                  f"{_text(row.get('intrinsic_error'))} | {_text(row.get('ratio'))} |" for row in summary]
        lines.append("")
    metrics = r.get("output") if isinstance(r.get("output"), dict) else {}
    if isinstance(metrics.get("device"), dict):  # {"device": {...}, "intrinsic": {...}, "ratio": x}
        metrics = metrics["device"]
    shown = [f"{k} {_fmt(v, 6)}" for k, v in metrics.items()
             if k in ("cosine", "rel_l2", "max_abs", "mean_abs") and isinstance(v, (int, float))]
    if shown:
        lines += ["Final output on the device against the golden: " + ", ".join(shown) + ".", ""]
    if gate.path is not None and (gate.path.parent / BLOCKS_PNG).is_file():  # copied next to the card
        lines += [f"![Per-block error against the {_text(r.get('dtype'))} budget]({BLOCKS_PNG})", ""]
    return lines
