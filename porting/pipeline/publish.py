"""`port publish`: a diffusers pipeline folder from a base repository and a converted transformer, gated on validation.

The folder is what the variant's pipeline (`Flux2KleinPipeline`, `FluxPipeline`, ... from the family registry)
loads with `from_pretrained(folder)`: `model_index.json`, the base's `scheduler/`, text encoders, tokenizers and `vae/`
(hard-linked, not copied, where the filesystem
allows), the converted `transformer/`, a model card, the validation report and a manifest with the sha256 of every
file. It is built next to the destination and moved into place only when complete.

The jobs live next to this file: `publish_inputs` (the base, the transformer, their fit), `publish_gate` (the
validation report), `publish_folder` (placing the files, model_index.json, manifest.json) and `publish_card`
(README.md).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from porting.adapters.publishing import card_section, check_adapters
from porting.errors import InputError, PortError
from porting.known_digests import carry_over
from porting.outputs import atomic_folder, check_output
from porting.reports import REPORTS, latest_report

from .publish_card import check_base_model, model_card
from .publish_folder import (
    LINK_MODES,
    MANIFEST,
    build_model_index,
    check_space,
    gather_sources,
    link_file,
    place_files,
    write_manifest,
)
from .publish_gate import Gate, check_report, refusal, report_sources
from .publish_inputs import check_consistency, infer_variant, read_base, transformer_identity, variant_spec

__all__ = ["LINK_MODES", "MANIFEST", "Gate", "PublishResult", "check_report", "link_file", "model_card", "publish",
           "variant_spec"]


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


def _find_report(report: str | Path | None, transformer: Path) -> tuple[str | Path | None, bool]:
    """The report to judge, and whether publish found it itself: without --report, the newest validate run under
    reports/ next to the transformer (port validate's default, and the workspace layout)."""
    if report is None and latest_report(transformer.parent / REPORTS) is not None:
        return latest_report(transformer.parent / REPORTS), True
    return report, False


def _gate_notices(gate: Gate, skip_validation: bool, transformer: Path, base: Path,
                  base_model: str | None) -> list[str]:
    """Refuse without a passing report unless `skip_validation`; the notices of what the card then says."""
    notices = []
    if not gate.passed and not skip_validation:
        raise refusal(gate, transformer)
    if not gate.passed:
        notices.append(f"validation skipped ({gate.message}); the model card says so")
    if base_model is None:
        notices.append(f"the model card names no base_model (the base is the local folder {base.resolve().name!r}); "
                       "pass --base-model ORG/NAME (e.g. black-forest-labs/FLUX.2-klein-4B) to link it")
    return notices


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
    report, found_report = _find_report(report, transformer)
    inputs = {"base": base, "transformer": transformer, "adapter": list(adapters),
              "report": transformer.parent / REPORTS if found_report else report}  # the folder publish looked in
    check_output(out, force=force, verb="publish", inputs=inputs)
    base_index = read_base(base)
    if not transformer.is_dir():
        raise InputError(f"{transformer}: converted transformer folder not found.",
                         hint="Convert the fine-tune first: port convert FILE --out DIR --strict.")
    say(f"hashing the transformer weights in {transformer}")
    weights, cfg, convert_manifest = transformer_identity(transformer)
    if found_report:  # the newest report of these weights, in a reports/ folder other transformers share
        report = latest_report(transformer.parent / REPORTS, weights)
    variant = variant or infer_variant(base_index, cfg)
    notices = check_consistency(base, base_index, cfg, variant)
    carried = check_adapters([Path(a) for a in adapters], cfg)  # converted adapters placed under adapters/NAME/
    if found_report:
        say(f"using the validation report in {report}")
    gate = check_report(Path(report) if report is not None else None, weights, cfg)
    notices += _gate_notices(gate, skip_validation, transformer, base, base_model)
    sources = gather_sources(base, base_index, transformer, carried)
    reports = report_sources(gate)
    total = check_space(out, sources, link)
    if on_start:
        on_start(2 * total)  # placing, then hashing
    pipeline = variant_spec(variant)[1].pipeline
    with atomic_folder(out, force=force, verb="publish", inputs=inputs, on_notice=notices.append) as staging:
        say(f"placing {len(sources)} files ({link})")
        files = place_files(staging, sources, link, hardlink, on_bytes)
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
        write_manifest(staging, files, placed, {
            "pipeline": pipeline, "variant": variant, "base": str(base.resolve()), "base_model": base_model,
            "transformer": str(transformer.resolve()), "weights_sha256": weights,
            "validation": {"status": gate.status, "message": gate.message, "enforced": not skip_validation}},
            on_bytes)
        linked = {rel: os.stat(staging / rel) for rel, f in files.items() if f["how"] == "hardlink"}
    for rel, st in linked.items():  # a replaced folder's links to the same files were just removed (--force)
        carry_over(st, out / rel)
    return PublishResult(out, variant, pipeline, weights, gate, skip_validation, files, notices,
                         time.perf_counter() - started)
