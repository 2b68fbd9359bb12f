"""One layout for every verb's reports: `reports/<verb>/<UTC time>/`, one run folder per run.

validate, compare and bench all write under a `reports/` folder (next to what they judged, or a recipe's
`<workspace>/<recipe>/reports/`). Each run writes a fresh run folder with its own ownership record, so no run ever
replaces another's report, any order of verbs re-runs cleanly, and a `--force` of a folder holding a `reports/`
(an ONNX export, a converted folder) accepts it: the shared folder and its verb folders carry a record listing the
folders flux-port made there, and each run folder carries its own (porting/ownership.py honours nested records).

`latest_report(folder)` finds the newest validate report under a reports/ folder, where `port publish` looks.
"""

from __future__ import annotations

import os
from pathlib import Path

from porting.outputs import note_made, timestamped_folder
from porting.ownership import add_folders, read_record

REPORTS = "reports"
VERBS = ("validate", "compare", "bench")
REPORT_JSON = "report.json"


def run_folder(root: Path, verb: str) -> Path:
    """A new `root/<verb>/<UTC time>/` path for one run (nothing is made until the run writes it)."""
    return timestamped_folder(Path(os.path.abspath(root)) / verb)


def prepare_run_folder(out: Path) -> None:
    """Before a run writes `out`: when `out` is a run folder of the shared layout (`.../reports/<verb>/<name>`),
    make `reports/` and `reports/<verb>/` and record them as flux-port's where flux-port makes them (a folder of
    the user's is used as it is, never claimed). Any other `out` is left to atomic_folder."""
    out = Path(os.path.abspath(out))
    verb_dir, root = out.parent, out.parent.parent
    if verb_dir.name not in VERBS or root.name != REPORTS:
        return
    made_root = not (root.exists() or root.is_symlink())
    root.mkdir(parents=True, exist_ok=True)
    made_verb = not (verb_dir.exists() or verb_dir.is_symlink())
    verb_dir.mkdir(exist_ok=True)
    for folder, made in ((root, made_root), (verb_dir, made_verb)):
        if made:  # removed again, when empty, if the run fails (atomic_folder)
            note_made(folder)
    if made_root or (made_verb and read_record(root) is not None) or _unrecorded_own(root, verb_dir.name):
        add_folders(root, "reports", [verb_dir.name])


def _unrecorded_own(root: Path, verb: str) -> bool:
    """A recorded shared folder whose record does not list this verb folder yet (an earlier single-folder
    validate report, say)."""
    record = read_record(root)
    return record is not None and record.files.get(verb) != "dir"


def _run_order(name: str) -> tuple[str, int]:
    """`20260101-120000-10` after `20260101-120000-9` (timestamped_folder's suffixes)."""
    stamp, _, n = name.rpartition("-") if name.count("-") >= 2 else (name, "", "1")
    return (stamp, int(n) if n.isdigit() else 0)


def latest_report(folder: Path, weights: str | None = None) -> Path | None:
    """The report.json a validate folder or a shared reports/ folder points to: FOLDER/report.json (a run folder,
    or the single-folder layout of earlier versions), else the newest FOLDER/validate/<time>/report.json; with
    `weights` (a sha256), the newest of those that validated these weights, if one did (a reports/ folder shared
    by several transformers: the demo's port and its merge), else the newest."""
    direct = folder / REPORT_JSON
    if direct.is_file():
        return direct
    runs = sorted((p for p in (folder / "validate").glob(f"*/{REPORT_JSON}") if p.is_file()),
                  key=lambda p: _run_order(p.parent.name))
    if weights is not None:
        mine = [p for p in runs if _validated(p) == weights]
        runs = mine or runs
    return runs[-1] if runs else None


def _validated(report: Path) -> str | None:
    """The weights sha256 a report.json records, None where it cannot be read."""
    import json

    try:
        with open(report, "rb") as f:
            doc = json.loads(f.read(1 << 24))  # a report is kilobytes; a huge file is not one
    except (OSError, ValueError):
        return None
    value = doc.get("weights_sha256") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None
