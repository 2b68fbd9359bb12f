"""The demo's work-folder bookkeeping (porting/cli/demo_cmd.py on porting/outputs.py and porting/ownership.py),
tested with steps that each write a small file instead of the whole tiny port: a rerun replaces only the demo's own
files, keeps what other verbs wrote, refuses when another verb wrote inside what it replaces, and each family's
default folder is its own. test_demo.py runs the real path end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from porting.cli.demo_cmd import DEFAULT_ROOT, _recorded, prepare_workdir
from porting.outputs import UnsafeOutputError, atomic_folder
from porting.ownership import RECORD, foreign_entries, read_record
from porting.reports import REPORTS, latest_report, prepare_run_folder, run_folder


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (the ownership records aside: a rerun rewrites them)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != RECORD}


def _verb_folder(out: Path, verb: str, files: dict[str, bytes]) -> Path:
    """What a verb writing a whole folder does (convert, publish): the folder appears at once, with its record."""
    with atomic_folder(out, verb=verb, replace="owned") as staging:
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
    return out


def _validate_report(reports: Path, text: bytes) -> Path:
    """What `port validate` does to write its report: a new run folder `reports/validate/<UTC time>/`, the shared
    folders recorded as flux-port's (validation/report.py's Report.write, with a one-line report)."""
    folder = run_folder(reports, "validate")
    prepare_run_folder(folder)
    with atomic_folder(folder, verb="validate", replace="owned") as staging:
        (staging / "report.json").write_bytes(text)
        (staging / "report.md").write_bytes(text)
    return folder


def _fake_demo(workdir: Path, run: str = "1") -> Path:
    """The demo's steps in its order, each writing a small file and then recorded as the demo's (as `_run` does);
    returns the demo's report run folder."""
    prepare_workdir(workdir)
    for entry in ("base", "finetune"):
        (workdir / entry).mkdir()
        (workdir / entry / "model.safetensors").write_text(f"{entry} {run}")
        _recorded(workdir, entry)
    _verb_folder(workdir / "transformer", "convert", {"model.safetensors": f"port {run}".encode()})
    _recorded(workdir, "transformer")
    report = _validate_report(workdir / REPORTS, f"demo report {run}".encode())
    _recorded(workdir, report.relative_to(workdir.absolute()).as_posix())
    _verb_folder(workdir / "published", "publish", {"model_index.json": run.encode(),
                                                    "transformer/model.safetensors": f"port {run}".encode()})
    _recorded(workdir, "published")
    (workdir / "demo.png").write_text(f"png {run}")
    _recorded(workdir, "demo.png")
    return report


def test_the_fake_steps_leave_a_folder_the_demo_owns_whole(tmp_path):
    work = tmp_path / "work"
    report = _fake_demo(work)
    assert foreign_entries(work) == []
    assert latest_report(work / REPORTS).parent == report.absolute()
    assert read_record(work).verb == "demo"


def test_a_second_family_goes_to_its_own_folder_and_keeps_the_users_reports(tmp_path, monkeypatch):
    """Each family's default folder is demo-out/FAMILY/; a second family's demo leaves the first one's folder, and
    the report a verb the user ran wrote there, byte for byte."""
    monkeypatch.chdir(tmp_path)
    klein, flux1 = DEFAULT_ROOT / "klein", DEFAULT_ROOT / "flux1"
    _fake_demo(klein)
    assert (klein / "published" / "model_index.json").is_file()
    _validate_report(klein.absolute() / REPORTS, b"the user's report")
    before = _files(klein)
    assert len(list((klein / REPORTS / "validate").iterdir())) == 2  # the demo's and the user's
    _fake_demo(flux1, run="flux1")
    assert _files(klein) == before
    assert (tmp_path / "demo-out" / "flux1" / "demo.png").is_file()
    assert (tmp_path / "demo-out" / "flux1" / "published" / "model_index.json").read_text() == "flux1"


def test_a_rerun_in_the_same_folder_replaces_the_demos_files_and_keeps_what_other_verbs_wrote(tmp_path):
    work = tmp_path / "work"
    demo_report = _fake_demo(work)
    user_report = _validate_report(work.absolute() / REPORTS, b"the user's report")
    assert user_report != demo_report
    _verb_folder(work / "mine", "convert", {"model.safetensors": b"the user's port"})  # another verb's --out
    kept = {name: _files(folder) for name, folder in (("report", user_report), ("mine", work / "mine"))}
    _fake_demo(work, run="2")
    assert {name: _files(folder) for name, folder in (("report", user_report), ("mine", work / "mine"))} == kept
    runs = sorted(p.name for p in (work / REPORTS / "validate").iterdir())
    assert len(runs) == 2 and user_report.name in runs  # the earlier demo's own report was replaced by this one's
    texts = sorted((work / REPORTS / "validate" / run / "report.json").read_bytes() for run in runs)
    assert texts == [b"demo report 2", b"the user's report"]  # (a run folder's name can come again in one second)
    assert (work / "demo.png").read_text() == "png 2" and (work / "base" / "model.safetensors").read_text() == "base 2"
    assert foreign_entries(work) == []  # the folder stays reusable
    _fake_demo(work, run="3")  # and reruns again
    assert _files(user_report) == kept["report"]
    assert foreign_entries(work) == []


def test_a_rerun_refuses_when_another_verb_wrote_inside_what_the_demo_replaces(tmp_path):
    work = tmp_path / "work"
    _fake_demo(work)
    _validate_report(work.absolute() / "published" / REPORTS, b"a report on published/transformer")
    assert (work / "published" / REPORTS / "validate").is_dir()
    before = _files(work)
    with pytest.raises(UnsafeOutputError) as exc:
        prepare_workdir(work)
    msg = f"{exc.value} {exc.value.hint}"
    assert "a new demo would replace published" in msg and "published/reports" in msg
    assert "nothing was changed" in msg and "--workdir OTHER" in msg
    assert _files(work) == before


def test_a_rerun_clears_all_the_demo_wrote_before_its_first_step(tmp_path):
    """With nothing of the user's in it, the cleared work folder holds only the demo's new record: its report run
    folder went, and reports/validate/ and reports/, which held nothing else, with it."""
    work = tmp_path / "work"
    _fake_demo(work)
    prepare_workdir(work)
    assert sorted(p.name for p in work.iterdir()) == [RECORD]
    assert read_record(work).files == {} and foreign_entries(work) == []


def test_a_rerun_keeps_an_image_port_generate_wrote_and_the_users_files_beside_the_demos(tmp_path):
    """The README's promise: the outputs of the commands the user ran on the demo folder are kept. An image `port
    generate -o WORK/fox.png` wrote (by its own writer, sealed as flux-port's) and a file of the user's beside the
    demo's entries stay, byte for byte, and the folder reruns again; an edited demo.png (in what the demo replaces)
    is still refused, named, nothing changed."""
    from PIL import Image

    from porting.pipeline.generate import save_png

    work = tmp_path / "work"
    _fake_demo(work)
    save_png(Image.new("RGB", (8, 8), (200, 40, 10)), work / "fox.png")
    (work / "notes.txt").write_text("prompts that worked")
    kept = {name: (work / name).read_bytes() for name in ("fox.png", "notes.txt")}
    _fake_demo(work, run="2")
    assert {name: (work / name).read_bytes() for name in kept} == kept
    assert (work / "demo.png").read_text() == "png 2"
    _fake_demo(work, run="3")  # and again
    assert {name: (work / name).read_bytes() for name in kept} == kept
    (work / "demo.png").write_text("edited by hand")
    before = _files(work)
    with pytest.raises(UnsafeOutputError, match="'demo.png'") as exc:
        prepare_workdir(work)
    assert "nothing was changed" in str(exc.value) and _files(work) == before
