"""`port publish`: a diffusers pipeline folder from a base repository and a converted transformer, gated on validation.

The folder is what the variant's pipeline (`Flux2KleinPipeline`, `FluxPipeline`, ... from the family registry)
loads with `from_pretrained(folder)`: `model_index.json`, the base's `scheduler/`, text encoders, tokenizers and `vae/`
(hard-linked, not copied, where the filesystem
allows), the converted `transformer/`, a model card, the validation report and a manifest with the sha256 of every
file. It is built next to the destination and moved into place only when complete.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

from porting import __version__
from porting._files import parse_json, read_json_object
from porting.adapters.publishing import adapter_sources, card_section, check_adapters
from porting.charts import BLOCKS_PNG
from porting.devices import validate_device
from porting.engine.convert import MANIFEST as CONVERT_MANIFEST
from porting.errors import CheckFailed, DiskSpaceError, InputError, PortError, UnsupportedFormatError, UsageError
from porting.families import Family, PipelineVariant, pipeline_variants
from porting.inputs import open_source
from porting.known_digests import file_sha256, known_sha256, remember
from porting.outputs import atomic_folder, check_output
from porting.paths import check_component_names, check_within, files_within, link_roots
from porting.reports import REPORTS, latest_report
from porting.text import markdown_code as _code
from porting.text import markdown_text as _md

LinkMode = Literal["hardlink", "symlink", "copy"]
LINK_MODES: tuple[str, ...] = ("hardlink", "symlink", "copy")
MANIFEST = "manifest.json"
REPORT_FILES = ("report.json", "report.md", BLOCKS_PNG)  # the chart only where validate drew one


def variant_spec(variant: str) -> tuple[Family, PipelineVariant]:
    """The family and pipeline facts of a publishable variant (klein, klein-kv, dev, ...)."""
    known = pipeline_variants()
    if variant not in known:
        raise PortError(f"--variant {variant!r}: choose one of {', '.join(known)}.")
    return known[variant]


@dataclass
class Gate:
    """The validation evidence for one transformer: `status` is pass, missing, fail, mismatch or unreadable."""

    status: str
    message: str
    path: Path | None = None
    report: dict[str, Any] | None = None

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class PublishResult:
    out: Path
    variant: str
    pipeline: str
    weights_sha256: str
    gate: Gate
    skip_validation: bool
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    notices: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for info in self.files.values():
            out[info["how"]] = out.get(info["how"], 0) + 1
        return dict(sorted(out.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"out": str(self.out), "variant": self.variant, "pipeline": self.pipeline,
                "weights_sha256": self.weights_sha256,
                "validation": {"status": self.gate.status, "message": self.gate.message,
                               "report": str(self.gate.path) if self.gate.path else None,
                               "enforced": not self.skip_validation},
                "files": len(self.files), "bytes": sum(f["bytes"] for f in self.files.values()),
                "how": self.counts(), "notices": self.notices, "seconds": round(self.seconds, 3)}


# ---------------------------------------------------------------------------------------------------------------
# reading the inputs

_read_json = read_json_object


def read_base(base: Path) -> dict[str, Any]:
    """The base repository's model_index.json, after checking its component folders exist."""
    if not base.is_dir():
        raise InputError(f"{base}: base folder not found.",
                         hint="Point --base at a diffusers-layout base repository (port fetch RECIPE downloads one).")
    index = _read_json(base / "model_index.json", "a diffusers base repository has one at its root")
    check_component_names(index, base / "model_index.json")
    for name in base_components(index):
        if not (base / name).is_dir():
            raise InputError(f"{base}: model_index.json lists component '{name}' but {base / name} is missing.",
                             hint="The base download is incomplete; run port fetch again.")
    return index


def base_components(index: dict[str, Any]) -> list[str]:
    """Components the base provides (everything in model_index.json but the transformer)."""
    return sorted(k for k, v in index.items() if not k.startswith("_") and k != "transformer"
                  and isinstance(v, list) and len(v) == 2 and v[0] is not None and v[1] is not None)


def infer_variant(base_index: dict[str, Any], transformer_cfg: dict[str, Any]) -> str:
    """The variant of the base's pipeline class; where one class serves several variants (FLUX.1 [dev] and
    [schnell] are both FluxPipeline), the one whose guidance embedding the transformer has."""
    from .variants import matching_variants

    same_class = matching_variants(base_index, transformer_cfg)
    if same_class:
        return same_class[0]
    for family, _ in pipeline_variants().values():
        if transformer_cfg.get("_class_name") == family.diffusers_class:
            return family.default_variant(transformer_cfg)
    raise InputError(f"the transformer's class {transformer_cfg.get('_class_name')!r} has no pipeline flux-port "
                     "publishes.", hint="Pass --variant, or publish a transformer of a family with pipelines.")


def transformer_identity(transformer: Path) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(weights sha256 recomputed from the files, config.json, convert's flux-port.json or {})."""
    cfg = _read_json(transformer / "config.json", "a converted transformer folder has one; port convert writes it")
    weights = open_source(transformer, kind="weights").weights_sha256
    convert_manifest: dict[str, Any] = {}
    if (transformer / CONVERT_MANIFEST).is_file():
        convert_manifest = _read_json(transformer / CONVERT_MANIFEST, "written by port convert")
        recorded = convert_manifest.get("weights_sha256")
        if recorded and recorded != weights:
            raise CheckFailed(
                f"{transformer}: weights changed since port convert wrote them (recorded {recorded[:16]}..., "
                f"files now {weights[:16]}...).",
                hint="Convert again (port convert ... --force) and validate the new weights before publishing.")
    return weights, cfg, convert_manifest


def check_consistency(base: Path, base_index: dict[str, Any], cfg: dict[str, Any], variant: str) -> list[str]:
    """Refuse a transformer that does not fit the base; returns notices for checks that could not run."""
    family, spec = variant_spec(variant)
    notices: list[str] = []
    problems: list[str] = []
    if cfg.get("_class_name") != family.diffusers_class:
        problems.append(f"transformer/config.json _class_name is {cfg.get('_class_name')!r}, the {spec.title} "
                        f"pipeline needs {family.diffusers_class!r}")
    if bool(cfg.get("guidance_embeds")) != spec.guidance_embeds:
        problems.append(f"transformer guidance_embeds is {bool(cfg.get('guidance_embeds'))}, {spec.title} has "
                        f"{spec.guidance_embeds}")
    base_cfg_path = base / "transformer" / "config.json"
    if base_cfg_path.is_file():
        for name, want, got in family.config_mismatches(_read_json(base_cfg_path, "base transformer config"), cfg):
            problems.append(f"{name}: base {base_cfg_path} has {want}, the fine-tune has {got}")
    else:
        notices.append(f"{base_cfg_path} not found: the fine-tune's architecture was only checked against the "
                       "other components")
    for component, wanted in spec.text_encoders.items():
        entry = base_index.get(component)
        found = entry[1] if isinstance(entry, list) and len(entry) == 2 else None
        if found != wanted:
            problems.append(f"base model_index.json {component} is {found!r}, {spec.pipeline} needs {wanted!r}")
    problems += family.pipeline_fit(base, cfg, spec)
    if problems:
        raise CheckFailed(
            f"the transformer does not fit the base {base} ({len(problems)} problem(s)); nothing was written.",
            details="\n".join(f"  {p}" for p in problems),
            hint="A fine-tune must be published with the base it was trained from (the same model and size), "
                 f"and --variant must match it (the base and transformer say {variant}).")
    return notices


def config_differences(validated: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Config fields (diffusers bookkeeping `_...` aside) whose value differs between validation and now."""
    a = {k: v for k, v in validated.items() if not k.startswith("_")}
    b = {k: v for k, v in current.items() if not k.startswith("_")}
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def check_report(report: Path | None, weights: str, config: dict[str, Any] | None = None) -> Gate:
    """Read a validate report (a report.json or the folder holding it) and judge it for these weights and, when
    given, this config.json: a config edited after validation (rope_theta, say) computes something else."""
    if report is None:
        return Gate("missing", "no validation report was given")
    path = (latest_report(report) or report / "report.json") if report.is_dir() else report
    if not path.is_file():
        return Gate("missing", f"{path} does not exist", path)
    try:
        data = parse_json(path.read_bytes(), str(path), kind=dict)
    except (OSError, InputError) as e:
        return Gate("unreadable", f"{path} is not a readable report ({e})", path)
    recorded = data.get("weights_sha256")
    if recorded != weights:
        return Gate("mismatch", f"{path} validated other weights ({str(recorded)[:16]}...; this transformer is "
                                f"{weights[:16]}...)", path, data)
    if data.get("runtime", "torch") != "torch":
        return Gate("mismatch", f"{path} validated a {data.get('runtime')} export, not this torch transformer",
                    path, data)
    if config is not None:
        validated = (data.get("model") or {}).get("config")
        if not isinstance(validated, dict):
            return Gate("mismatch", f"{path} does not record the config it validated (an older report)", path, data)
        changed = config_differences(validated, config)
        if changed:
            return Gate("mismatch", f"transformer/config.json changed since {path} was written "
                                    f"({', '.join(changed[:5])})", path, data)
    if data.get("verdict") != "pass":
        return Gate("fail", f"{path} has verdict {data.get('verdict')!r}", path, data)
    return Gate("pass", f"{path}: verdict pass on {data.get('device')} {data.get('dtype')}", path, data)


def refusal(gate: Gate, transformer: Path) -> CheckFailed:
    hints = {
        "missing": f"Validate first: port validate {transformer} --device {validate_device()} (it writes "
                   f"{transformer.parent / REPORTS}/validate/<UTC time>/report.json, which publish then finds), or "
                   "pass --report.",
        "mismatch": f"The report belongs to other weights or another config: validate this transformer "
                    f"({transformer}) as it is now and pass its report.",
        "fail": "Read report.md for the blamed block; a failing port must not be published.",
        "unreadable": "Run port validate again to write a fresh report.json.",
    }
    return CheckFailed(f"refusing to publish: {gate.message}.",
                       hint=hints.get(gate.status, "") + " (--skip-validation publishes anyway and says so in the "
                                                         "model card.)")


# ---------------------------------------------------------------------------------------------------------------
# writing

def link_file(src: Path, dst: Path, mode: str, hardlink: Callable[[Path, Path], None] = os.link) -> str:
    """Place `src` at `dst` by `mode`; returns how it was placed. A hard link that the filesystem refuses
    (another device, no link support, too many links) falls back to a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if mode == "hardlink":
        try:
            hardlink(src, dst)
            return "hardlink"
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP,
                               errno.EACCES):
                raise
    elif mode == "symlink":
        os.symlink(os.path.abspath(src), dst)
        return "symlink"
    shutil.copy2(src, dst)
    return "copy"


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def refuse_pickles(files: list[Path]) -> None:
    """A base holding pickle weights is refused the way convert refuses a pickle checkpoint: loading one can run
    arbitrary code, and a published folder would pass it on."""
    pickles = [f for f in files if f.suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        shown = ", ".join(str(p) for p in pickles[:3]) + (f" and {len(pickles) - 3} more" if len(pickles) > 3 else "")
        raise UnsupportedFormatError(
            f"the base holds pickle weights ({shown}); they can run arbitrary code when loaded, so flux-port "
            "refuses to publish them.",
            hint="Use a base with .safetensors weights (the official repositories have them), or convert the "
                 "component to safetensors in a sandbox you trust.")


def report_sources(gate: Gate) -> list[tuple[Path, str]]:
    """(file, name in the published folder) for report.json and report.md next to the report that was judged;
    each must lie, links resolved, inside that report's folder."""
    if gate.path is None or gate.report is None:
        return []
    folder = gate.path.parent
    found = [(folder / name, name) for name in REPORT_FILES if (folder / name).is_file()]
    for src, _ in found:
        check_within(src, link_roots(folder), "report file")
    return found


def build_model_index(base_index: dict[str, Any], variant: str) -> dict[str, Any]:
    import diffusers

    family, spec = variant_spec(variant)
    index: dict[str, Any] = {"_class_name": spec.pipeline, "_diffusers_version": diffusers.__version__}
    if spec.registers_is_distilled and "is_distilled" in base_index:
        index["is_distilled"] = bool(base_index["is_distilled"])
    for name in base_components(base_index):
        index[name] = list(base_index[name])
    for name, entry in base_index.items():  # optional components the base leaves empty (FluxPipeline's image encoder)
        if not name.startswith("_") and entry == [None, None]:
            index[name] = [None, None]
    index["transformer"] = ["diffusers", family.diffusers_class]
    return dict(sorted(index.items(), key=lambda kv: (not kv[0].startswith("_"), kv[0])))


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
    """--base-model is a Hub repo id (ORG/NAME) or a plain name; anything else would be injected into the card."""
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


def publish(base: str | Path, transformer: str | Path, out: str | Path, *, report: str | Path | None = None,
            link: str = "hardlink", skip_validation: bool = False, variant: str | None = None,
            base_model: str | None = None, force: bool = False, adapters: Sequence[str | Path] = (),
            on_status: Callable[[str], None] | None = None,
            on_start: Callable[[int], None] | None = None, on_bytes: Callable[[int], None] | None = None,
            hardlink: Callable[[Path, Path], None] = os.link) -> PublishResult:
    """Assemble a diffusers pipeline folder at `out` from `base` and a converted `transformer`.

    Refuses (CheckFailed, exit 1) without a passing report.json for exactly these weights unless
    `skip_validation`, and when the transformer does not fit the base. `hardlink` is the link call, replaceable
    in tests to simulate a filesystem that refuses hard links.
    """
    started = time.perf_counter()
    base, transformer, out = Path(base), Path(transformer), Path(out)
    say = on_status or (lambda text: None)
    if link not in LINK_MODES:
        raise PortError(f"--link {link!r}: choose one of {', '.join(LINK_MODES)}.")
    if variant is not None:
        variant_spec(variant)
    if base_model is not None:
        check_base_model(base_model)
    found_report = report is None and latest_report(transformer.parent / REPORTS) is not None
    if found_report:  # the newest validate run under reports/ next to the transformer (port validate's default,
        report = latest_report(transformer.parent / REPORTS)  # and the workspace layout)
    inputs = {"base": base, "transformer": transformer, "adapter": list(adapters),
              "report": transformer.parent / REPORTS if found_report else report}  # the folder publish looked in
    check_output(out, force=force, verb="publish", inputs=inputs)
    base_index = read_base(base)
    if not transformer.is_dir():
        raise InputError(f"{transformer}: converted transformer folder not found.",
                         hint="Convert the fine-tune first: port convert FILE --out DIR --strict.")
    say(f"hashing the transformer weights in {transformer}")
    weights, cfg, convert_manifest = transformer_identity(transformer)
    variant = variant or infer_variant(base_index, cfg)
    notices = check_consistency(base, base_index, cfg, variant)
    carried = check_adapters([Path(a) for a in adapters], cfg)  # converted adapters placed under adapters/NAME/
    if found_report:
        say(f"using the validation report in {report}")
    gate = check_report(Path(report) if report is not None else None, weights, cfg)
    if not gate.passed and not skip_validation:
        raise refusal(gate, transformer)
    if not gate.passed:
        notices.append(f"validation skipped ({gate.message}); the model card says so")
    if base_model is None:
        notices.append(f"the model card names no base_model (the base is the local folder {base.resolve().name!r}); "
                       "pass --base-model ORG/NAME (e.g. black-forest-labs/FLUX.2-klein-4B) to link it")

    sources: list[tuple[Path, Path]] = [(f, Path(name) / f.relative_to(base / name))
                                        for name in base_components(base_index)
                                        for f in files_within(base / name, link_roots(base))]
    refuse_pickles([src for src, _ in sources])
    sources += [(f, Path("transformer") / f.relative_to(transformer)) for f in files_within(transformer)]
    sources += adapter_sources(carried)
    reports = report_sources(gate)
    total = sum(src.stat().st_size for src, _ in sources)
    if link == "copy":
        free = shutil.disk_usage(out.resolve().parent if out.parent.exists() else Path.cwd()).free
        if free < total:
            raise DiskSpaceError(f"{out.parent}: copying needs {total / 1e9:.2f} GB, {free / 1e9:.2f} GB free.",
                                 hint="Use --link hardlink or symlink, or free some space.")
    if on_start:
        on_start(2 * total)  # placing, then hashing
    files: dict[str, dict[str, Any]] = {}
    with atomic_folder(out, force=force, verb="publish", inputs=inputs, on_notice=notices.append) as staging:
        say(f"placing {len(sources)} files ({link})")
        for src, rel in sources:
            known = known_sha256(src)
            how = link_file(src, staging / rel, link, hardlink)
            if how == "copy" and known is not None and known_sha256(src) == known:  # the same bytes, unchanged
                remember(staging / rel, known)
            files[rel.as_posix()] = {"how": how}
            if on_bytes:
                on_bytes(src.stat().st_size)
        placed = set(files)
        copied = [r for r, f in files.items() if f["how"] == "copy"]
        if link == "hardlink" and copied:
            notices.append(f"hard links not possible from {base} or {transformer} to {out} (another filesystem?); "
                           f"copied {len(copied)} file(s) instead")
        (staging / "model_index.json").write_text(json.dumps(build_model_index(base_index, variant), indent=2) + "\n")
        files["model_index.json"] = {"how": "written"}
        for src, name in reports:
            shutil.copy2(src, staging / name)
            files[name] = {"how": "copy"}
        card = model_card(name=out.name, base_model=base_model, base=base, variant=variant, weights=weights,
                          gate=gate, skip_validation=skip_validation, convert_manifest=convert_manifest)
        from .cardtables import card_markdown, report_roots  # latest compare / bench tables of these weights
        card += card_markdown(weights, report_roots(transformer))
        (staging / "README.md").write_text(card + card_section(out.name, carried))
        files["README.md"] = {"how": "written"}
        say("hashing every file for manifest.json (files flux-port hashed before and unchanged since are not read)")
        for rel, info in files.items():
            info["bytes"] = (staging / rel).stat().st_size
            info["sha256"] = file_sha256(staging / rel, on_bytes if rel in placed else None)
        pipeline = variant_spec(variant)[1].pipeline
        manifest = {
            "tool": "flux-port", "version": __version__, "format_version": 1, "pipeline": pipeline,
            "variant": variant, "base": str(base.resolve()), "base_model": base_model,
            "transformer": str(transformer.resolve()), "weights_sha256": weights,
            "validation": {"status": gate.status, "message": gate.message, "enforced": not skip_validation},
            "files": dict(sorted(files.items())),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return PublishResult(out, variant, pipeline, weights, gate, skip_validation, files, notices,
                         time.perf_counter() - started)
