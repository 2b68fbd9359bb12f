"""`port publish`'s gate: the validation report judged for exactly these weights and this config."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from porting._files import parse_json
from porting.charts import BLOCKS_PNG
from porting.devices import validate_device
from porting.errors import CheckFailed, InputError
from porting.paths import check_within, link_roots
from porting.reports import REPORTS, latest_report

REPORT_FILES = ("report.json", "report.md", BLOCKS_PNG)  # the chart only where validate drew one


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

