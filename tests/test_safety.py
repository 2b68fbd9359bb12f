"""Data safety: the tool deletes or replaces only what it can prove it wrote, never writes over or around its
inputs, and never publishes through a link out of the folders it publishes from.

Every case hashes the files around the output before and after, and asserts exit code, message and no traceback.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import pytest

from porting.cli.demo_cmd import DEMO_ENTRIES, prepare_workdir
from porting.errors import InputError, OutputExistsError
from porting.outputs import RECORD, UnsafeOutputError, atomic_folder, check_replaceable, foreign_entries
from porting.ownership import extend_record, write_staging_marker
from porting.pipeline.publish import publish

from .helpers import leftovers, run_port


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file (and the target of every link) under `root`, links not followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames + [d for d in dirnames if (Path(dirpath) / d).is_symlink()]:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            out[rel] = ("link:" + os.readlink(p)) if p.is_symlink() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_clean_refusal(run, code: int, *phrases: str) -> None:
    assert run.code == code, run.err
    assert "Traceback" not in run.err and run.out == ""
    for phrase in phrases:
        assert phrase in run.msg, run.msg



@pytest.fixture
def user_folder(tmp_path: Path, tiny2_file: Path) -> Path:
    """A user's folder: the only copy of a fine-tune, their notes, and another model."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny2_file, folder / "my-finetune.safetensors")
    (folder / "notes.txt").write_text("lr 1e-4, 3000 steps\n")
    (folder / "other-model").mkdir()
    (folder / "other-model" / "weights.bin").write_bytes(os.urandom(64))
    return folder


# --- convert ---------------------------------------------------------------------------------------------------------

def test_convert_force_into_the_folder_holding_the_source_is_refused(capsys, user_folder: Path) -> None:
    before = snapshot(user_folder)
    run = run_port(capsys, "convert", user_folder / "my-finetune.safetensors", "--out", user_folder, "--force")
    assert_clean_refusal(run, 2, "the output contains the source", "Nothing was changed")
    assert snapshot(user_folder) == before and leftovers(user_folder) == ["models"]


def test_convert_force_onto_the_source_file_is_refused(capsys, user_folder: Path) -> None:
    src = user_folder / "my-finetune.safetensors"
    before = snapshot(user_folder)
    run = run_port(capsys, "convert", src, "--out", src, "--force")
    assert_clean_refusal(run, 2, "the output is the source")
    assert snapshot(user_folder) == before and src.is_file()


def test_convert_force_over_a_folder_of_user_files_is_refused(capsys, user_folder: Path, tiny2_file: Path) -> None:
    before = snapshot(user_folder)
    run = run_port(capsys, "convert", tiny2_file, "--out", user_folder, "--force")
    assert_clean_refusal(run, 2, "was not written by flux-port", "nothing was changed")
    assert snapshot(user_folder) == before


def test_convert_force_replaces_its_own_output_but_not_one_with_a_user_file_added(capsys, tmp_path: Path,
                                                                                 tiny2_file: Path) -> None:
    out = tmp_path / "transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", out, "-q").code == 0
    assert foreign_entries(out) == []
    assert run_port(capsys, "convert", tiny2_file, "--out", out, "--force", "-q").code == 0
    (out / "my-notes.md").write_text("keep")
    before = snapshot(out)
    run = run_port(capsys, "convert", tiny2_file, "--out", out, "--force")
    assert_clean_refusal(run, 2, "holds files flux-port did not write ('my-notes.md')")
    assert snapshot(out) == before


def test_convert_output_inside_an_input_folder_is_refused(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    diffusers_folder = tmp_path / "transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", diffusers_folder, "-q").code == 0
    before = snapshot(tmp_path)
    run = run_port(capsys, "convert", diffusers_folder, "--to", "original", "--out", diffusers_folder / "orig")
    assert_clean_refusal(run, 2, "the output lies inside the source")
    assert snapshot(tmp_path) == before


def test_output_through_a_link_to_the_source_folder_is_refused(capsys, user_folder: Path, tmp_path: Path) -> None:
    link = tmp_path / "alias"
    link.symlink_to(user_folder)
    before = snapshot(user_folder)
    run = run_port(capsys, "convert", user_folder / "my-finetune.safetensors", "--out", link, "--force")
    assert_clean_refusal(run, 2, "the output contains the source")
    assert snapshot(user_folder) == before and link.is_symlink()


# --- publish ---------------------------------------------------------------------------------------------------------

def test_publish_force_into_the_folder_holding_its_inputs_is_refused(port: dict) -> None:
    root = port["root"]
    before = snapshot(root)
    with pytest.raises(UnsafeOutputError, match="the output contains the base"):
        publish(port["base"], port["transformer"], root, report=port["pass"], force=True)
    assert snapshot(root) == before


def test_publish_cli_refusal_names_the_input(capsys, port: dict) -> None:
    before = snapshot(port["root"])
    run = run_port(capsys, "publish", "--base", port["base"], "--transformer", port["transformer"],
                   "--report", port["pass"], "--out", port["base"], "--force")
    assert_clean_refusal(run, 2, "the output is the base")
    assert snapshot(port["root"]) == before


@pytest.mark.parametrize("link", ["copy", "hardlink", "symlink"])
def test_publish_never_follows_a_link_out_of_the_base(port: dict, tmp_path: Path, link: str) -> None:
    base = tmp_path / "base"
    shutil.copytree(port["base"], base, symlinks=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("ssh key")
    (base / "vae" / "notes.txt").symlink_to(secret)
    out = tmp_path / "pub"
    with pytest.raises(InputError, match=r"notes.txt: a symbolic link to .*secret.txt, outside"):
        publish(base, port["transformer"], out, report=port["pass"], link=link)
    assert not out.exists() and leftovers(out) == []


def test_publish_follows_links_inside_a_hub_cache_snapshot(port: dict, tmp_path: Path) -> None:
    """A base given as a Hugging Face cache snapshot links into its own blobs/: that is inside, not out."""
    cache = tmp_path / "models--org--base"
    snapshot_dir = cache / "snapshots" / "0123abc"
    (cache / "blobs").mkdir(parents=True)
    for src in sorted(Path(port["base"]).rglob("*")):
        rel = src.relative_to(port["base"])
        dst = snapshot_dir / rel
        if src.is_dir():
            dst.mkdir(parents=True, exist_ok=True)
            continue
        blob = cache / "blobs" / hashlib.sha256(rel.as_posix().encode()).hexdigest()
        shutil.copy(src, blob)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(os.path.relpath(blob, dst.parent))
    out = tmp_path / "pub"
    publish(snapshot_dir, port["transformer"], out, report=port["pass"], link="copy")
    assert (out / "vae" / "config.json").is_file() and not (out / "vae" / "config.json").is_symlink()


# --- demo ------------------------------------------------------------------------------------------------------------

def test_demo_refuses_a_workdir_holding_other_files(capsys, user_folder: Path) -> None:
    before = snapshot(user_folder)
    run = run_port(capsys, "demo", "--workdir", user_folder)
    assert_clean_refusal(run, 2, "demo work folder exists and was not written by flux-port")
    assert snapshot(user_folder) == before


def test_demo_refuses_the_current_folder(capsys, user_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(user_folder)
    before = snapshot(user_folder)
    run = run_port(capsys, "demo", "--workdir", ".")
    assert_clean_refusal(run, 2, "not written by flux-port")
    assert snapshot(user_folder) == before


def test_demo_workdir_is_reused_only_while_it_holds_only_demo_files(tmp_path: Path) -> None:
    work = tmp_path / "demo-out"
    prepare_workdir(work)
    for name in DEMO_ENTRIES[:-1]:
        (work / name).mkdir()
        (work / name / "x.bin").write_bytes(b"1")
        extend_record(work, "demo", [name])  # what each demo step does after writing its entry
    prepare_workdir(work)  # an earlier demo's folder: emptied
    assert sorted(p.name for p in work.iterdir()) == [RECORD]
    (work / "base").mkdir()
    (work / "base" / "x.bin").write_bytes(b"1")
    extend_record(work, "demo", ["base"])
    (work / "base" / "thesis.tex").write_text("years of work")  # a user file inside a folder the demo wrote
    before = snapshot(work)
    with pytest.raises(UnsafeOutputError, match="'base/thesis.tex'"):
        prepare_workdir(work)
    assert snapshot(work) == before


# --- validate --------------------------------------------------------------------------------------------------------

def test_validate_refuses_a_report_folder_of_user_files_before_running(capsys, user_folder: Path,
                                                                        tiny2_file: Path) -> None:
    before = snapshot(user_folder)
    run = run_port(capsys, "validate", tiny2_file, "--out", user_folder, "--resolution", "32", "--text-len", "8")
    assert_clean_refusal(run, 2, "was not written by flux-port")
    assert snapshot(user_folder) == before


# --- leftovers and concurrent runs -----------------------------------------------------------------------------------

def test_a_dead_runs_staging_folder_is_removed_and_reported(capsys, tmp_path: Path, tiny2_file: Path) -> None:
    out = tmp_path / "transformer"
    stale = tmp_path / ".transformer.partial-dead1234"
    stale.mkdir()
    write_staging_marker(stale)  # as a run does when it starts; the run was then killed (its lock died with it)
    (stale / "diffusion_pytorch_model.safetensors").write_bytes(b"half written")
    run = run_port(capsys, "convert", tiny2_file, "--out", out)
    assert run.code == 0, run.err
    assert "removed .transformer.partial-dead1234, left in" in run.msg and "by an earlier interrupted run" in run.msg
    assert leftovers(out) == ["transformer"]


def test_a_live_run_on_the_same_output_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "transformer"
    with atomic_folder(out, verb="convert") as staging:
        (staging / "a.txt").write_text("first run")
        with pytest.raises(UnsafeOutputError, match="another flux-port run is writing this output now"):
            with atomic_folder(out, verb="convert"):
                pass
    assert (out / "a.txt").read_text() == "first run"
    assert leftovers(out) == ["transformer"]


def test_a_locked_staging_folder_of_another_process_is_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "transformer"
    other = tmp_path / ".transformer.partial-live"
    other.mkdir()
    write_staging_marker(other)
    fd = os.open(other, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(UnsafeOutputError, match="another flux-port run"):
            with atomic_folder(out, verb="convert"):
                pass
        assert other.is_dir() and not out.exists()
    finally:
        os.close(fd)


# --- generate --------------------------------------------------------------------------------------------------------

def test_generate_never_overwrites_an_image_it_did_not_write(capsys, port: dict, tmp_path: Path) -> None:
    from PIL import Image

    from porting.pipeline.generate import check_image_replaceable, save_png

    published = tmp_path / "pub"
    publish(port["base"], port["transformer"], published, report=port["pass"])
    photo = tmp_path / "holiday.png"
    Image.new("RGB", (8, 8), (200, 10, 10)).save(photo)
    before = photo.read_bytes()
    run = run_port(capsys, "generate", published, "--prompt", "x", "--size", "32", "--steps", "1", "--output", photo)
    assert_clean_refusal(run, 2, "the file exists and was not written by flux-port")
    assert photo.read_bytes() == before
    ours = tmp_path / "ours.png"
    save_png(Image.new("RGB", (8, 8)), ours)
    with pytest.raises(OutputExistsError, match="already exists"):
        check_image_replaceable(ours)  # not even flux-port's own image without --force
    check_image_replaceable(ours, force=True)  # an image flux-port wrote may be replaced when asked


def test_generate_replaces_its_own_image_only_with_force(capsys, port: dict, tmp_path: Path) -> None:
    published = tmp_path / "pub"
    publish(port["base"], port["transformer"], published, report=port["pass"])
    image = tmp_path / "fox.png"
    args = ("generate", published, "--prompt", "x", "--size", "32", "--steps", "1", "--output", image, "-q")
    assert run_port(capsys, *args).code == 0
    neighbours = snapshot(tmp_path)
    run = run_port(capsys, *args)
    assert_clean_refusal(run, 2, f"--output {image}: the file already exists", "--force")
    assert snapshot(tmp_path) == neighbours
    assert run_port(capsys, *args, "--force").code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fox.png", "pub"]  # no partial file left beside it


def test_generate_steps_zero_is_refused_not_run_with_the_default(capsys, port: dict, tmp_path: Path) -> None:
    published = tmp_path / "pub"
    publish(port["base"], port["transformer"], published, report=port["pass"])
    run = run_port(capsys, "generate", published, "--prompt", "x", "--steps", "0", "--output", tmp_path / "a.png")
    assert_clean_refusal(run, 2, "--steps 0: needs at least 1")
    assert not (tmp_path / "a.png").exists()


def test_out_dot_is_refused_in_a_folder_of_user_files_and_leaves_nothing(capsys, user_folder: Path, tiny2_file: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(user_folder)
    before = snapshot(user_folder.parent)
    run = run_port(capsys, "convert", tiny2_file, "--out", ".", "--force")
    assert_clean_refusal(run, 2, "was not written by flux-port")
    assert snapshot(user_folder.parent) == before  # no staging folder inside or next to it


def test_out_dot_in_an_empty_folder_converts_next_to_nothing_else(capsys, tmp_path: Path, tiny2_file: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "empty"
    work.mkdir()
    monkeypatch.chdir(work)
    run = run_port(capsys, "convert", tiny2_file, "--out", ".", "--force", "-q")
    assert run.code == 0, run.err
    assert (work / "diffusion_pytorch_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # the staging folder was moved into place


# --- ownership is per file, bound to the folder and the machine ------------------------------------------------------

def test_publish_force_refuses_a_note_added_inside_a_component_folder(capsys, port: dict, tmp_path: Path) -> None:
    out = tmp_path / "published"
    args = ("publish", "--base", port["base"], "--transformer", port["transformer"], "--report", port["pass"],
            "--out", out, "--force", "-q")
    assert run_port(capsys, *args).code == 0
    assert run_port(capsys, *args).code == 0  # its own output, untouched: replaced
    (out / "transformer" / "my-notes.md").write_text("which lr worked")
    before = snapshot(tmp_path)
    run = run_port(capsys, *args)
    assert_clean_refusal(run, 2, "holds files flux-port did not write ('transformer/my-notes.md')")
    assert snapshot(tmp_path) == before


def test_a_file_flux_port_wrote_and_someone_changed_is_no_longer_its_own(capsys, tmp_path: Path,
                                                                        tiny2_file: Path) -> None:
    out = tmp_path / "transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", out, "-q").code == 0
    with (out / "config.json").open("a") as f:
        f.write("\n")  # the user's edit: another size than flux-port recorded
    before = snapshot(tmp_path)
    run = run_port(capsys, "convert", tiny2_file, "--out", out, "--force")
    assert_clean_refusal(run, 2, "('config.json')")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("how", ["copytree", "downloaded"])
def test_a_copied_or_downloaded_ownership_record_proves_nothing(capsys, tmp_path: Path, tiny2_file: Path,
                                                               how: str) -> None:
    out = tmp_path / "transformer"
    assert run_port(capsys, "convert", tiny2_file, "--out", out, "-q").code == 0
    copy = tmp_path / "a-repository"
    if how == "copytree":  # cp -r of an output: same record, another folder
        shutil.copytree(out, copy)
    else:  # a repository that ships a record made on another machine (another key), for a folder with user files
        copy.mkdir()
        (copy / "their-weights.safetensors").write_bytes(b"x" * 64)
        doc = __import__("json").loads((out / RECORD).read_text())
        doc["files"] = {"their-weights.safetensors": 64}
        (copy / RECORD).write_text(__import__("json").dumps(doc))
    before = snapshot(tmp_path)
    run = run_port(capsys, "convert", tiny2_file, "--out", copy, "--force")
    assert_clean_refusal(run, 2, "was not written by flux-port", "a copied or downloaded one proves nothing")
    assert snapshot(tmp_path) == before


def test_a_record_edited_to_claim_a_users_file_proves_nothing(tmp_path: Path) -> None:
    import json

    out = tmp_path / "transformer"
    with atomic_folder(out, verb="convert") as staging:
        (staging / "a.safetensors").write_bytes(b"1")
    (out / "thesis.tex").write_text("years of work")
    doc = json.loads((out / RECORD).read_text())
    doc["files"]["thesis.tex"] = len("years of work")  # claimed, but the seal no longer matches
    (out / RECORD).write_text(json.dumps(doc))
    assert foreign_entries(out) is None
    with pytest.raises(UnsafeOutputError, match="was not written by flux-port"):
        check_replaceable(out)


def test_reports_flux_port_wrote_inside_an_output_are_its_own(tmp_path: Path) -> None:
    out = tmp_path / "transformer"
    with atomic_folder(out, verb="convert") as staging:
        (staging / "a.safetensors").write_bytes(b"1")
    with atomic_folder(out / "reports" / "compare" / "run1", verb="compare") as staging:  # a report written inside
        (staging / "compare.json").write_text("{}")
    assert foreign_entries(out) == []
    check_replaceable(out)
    (out / "reports" / "compare" / "note.md").write_text("mine")
    assert foreign_entries(out) == ["reports/compare/note.md"]
    (out / "reports" / "compare" / "note.md").unlink()
    (out / "reports" / "empty-folder-of-mine").mkdir()
    assert foreign_entries(out) == ["reports/empty-folder-of-mine"]


def test_validate_replaces_only_its_own_report_folder(tmp_path: Path) -> None:
    converted = tmp_path / "transformer"
    with atomic_folder(converted, verb="convert") as staging:
        (staging / "a.safetensors").write_bytes(b"1")
    before = snapshot(tmp_path)
    with pytest.raises(UnsafeOutputError, match="is the output of `port convert`, not of `port validate`"):
        with atomic_folder(converted, verb="validate", replace="owned"):
            pass
    assert snapshot(tmp_path) == before


# --- leftovers are only flux-port's ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [".transformer.partial-mine", ".transformer.old-2024", ".transformer.partial-x"])
def test_folders_named_like_leftovers_but_not_made_by_a_run_are_left_alone(capsys, tmp_path: Path,
                                                                           tiny2_file: Path, name: str) -> None:
    alike = tmp_path / name
    alike.mkdir()
    (alike / "drafts.txt").write_text("my drafts")
    before = snapshot(alike)
    run = run_port(capsys, "convert", tiny2_file, "--out", tmp_path / "transformer")
    assert run.code == 0, run.err
    assert "removed" not in run.msg
    assert snapshot(alike) == before


def test_a_copied_staging_marker_does_not_make_a_folder_a_leftover(tmp_path: Path) -> None:
    real = tmp_path / ".transformer.partial-real"
    real.mkdir()
    write_staging_marker(real)
    copy = tmp_path / ".transformer.partial-copy"
    shutil.copytree(real, copy)
    (copy / "work.txt").write_text("mine")
    with atomic_folder(tmp_path / "transformer", verb="convert"):
        pass
    assert not real.exists()  # a dead run's own staging folder: cleared
    assert (copy / "work.txt").read_text() == "mine"  # the marker names another folder: left alone
