"""Issue 29, rule 1: proof is sealed or it is not proof. A single file `--force` may replace is flux-port's only by
the sealed record of this machine's flux-port (not by a PNG text chunk anyone can write), and the per-user key
that seals records is used only when it is what the docs promise (32 random bytes that only the user can read)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from porting.errors import OutputExistsError
from porting.outputs import UnsafeOutputError
from porting.ownership import SealingKeyError, file_is_flux_ports, read_record, write_record
from porting.pipeline.generate import PNG_SOFTWARE, check_image_replaceable, save_png
from tests.hubserver.harness import cli, client_env, hubs  # noqa: F401  (fixtures)
from tests.hubserver.server import Repo, tiny_pipeline_files

from .helpers import leftovers, run_port


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state folder of this test's own (the key cache is per FLUX_PORT_STATE_DIR value, so each test gets its
    key fresh)."""
    folder = tmp_path / "state"
    monkeypatch.setenv("FLUX_PORT_STATE_DIR", str(folder))
    return folder


def test_a_png_tagged_software_flux_port_is_not_proof(state, tmp_path):
    forged = tmp_path / "holiday.png"
    info = PngInfo()
    info.add_text("Software", PNG_SOFTWARE)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(forged, pnginfo=info)
    before = forged.read_bytes()
    with pytest.raises(UnsafeOutputError, match="was not written by flux-port"):
        check_image_replaceable(forged, force=True)
    assert forged.read_bytes() == before


def test_an_image_flux_port_wrote_is_proven_and_replaceable_only_with_force(state, tmp_path):
    ours = tmp_path / "ours.png"
    save_png(Image.new("RGB", (8, 8)), ours)
    assert file_is_flux_ports(ours)
    with pytest.raises(OutputExistsError):
        check_image_replaceable(ours)
    check_image_replaceable(ours, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.png", "state"]  # the record lives in the state


def test_a_copy_an_edit_or_another_key_proves_nothing(state, tmp_path, monkeypatch):
    ours = tmp_path / "ours.png"
    save_png(Image.new("RGB", (8, 8)), ours)
    copy = tmp_path / "copy.png"
    shutil.copy2(ours, copy)  # same bytes, same time, another inode
    assert not file_is_flux_ports(copy)
    moved = tmp_path / "moved.png"
    os.rename(copy, moved)
    assert not file_is_flux_ports(moved)
    edited = tmp_path / "edited.png"
    save_png(Image.new("RGB", (8, 8)), edited)
    st = os.stat(edited)
    raw = bytearray(edited.read_bytes())
    raw[-20] ^= 0xFF  # same size, then the old modification time put back: only the hash tells
    edited.write_bytes(bytes(raw))
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not file_is_flux_ports(edited)
    renamed = tmp_path / "renamed.png"
    os.rename(ours, renamed)  # `mv` keeps the inode: still flux-port's
    assert file_is_flux_ports(renamed)
    monkeypatch.setenv("FLUX_PORT_STATE_DIR", str(tmp_path / "other-state"))  # another user's key
    assert not file_is_flux_ports(renamed)


def test_a_forged_record_in_the_state_folder_is_not_proof(state, tmp_path):
    ours = tmp_path / "ours.png"
    save_png(Image.new("RGB", (8, 8)), ours)
    record = next((state / "files").iterdir())
    doc = json.loads(record.read_text())
    victim = tmp_path / "victim.png"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(victim)
    st = os.stat(victim)
    doc["file"].update(device=st.st_dev, inode=st.st_ino, size=st.st_size, mtime_ns=st.st_mtime_ns)
    (state / "files" / f"{st.st_dev}-{st.st_ino}.json").write_text(json.dumps(doc))  # the old seal
    assert not file_is_flux_ports(victim)


@pytest.mark.parametrize("problem", ["short", "long", "group-readable", "world-readable", "link", "folder"])
def test_a_key_that_is_not_what_the_docs_promise_is_refused_with_how_to_remake_it(state, tmp_path, problem):
    state.mkdir(mode=0o700)
    key = state / "ownership.key"
    if problem == "link":
        (tmp_path / "elsewhere").write_bytes(os.urandom(32))
        os.chmod(tmp_path / "elsewhere", 0o600)
        key.symlink_to(tmp_path / "elsewhere")
    elif problem == "folder":
        key.mkdir()
    else:
        key.write_bytes(os.urandom({"short": 8, "long": 64}.get(problem, 32)))
        os.chmod(key, {"group-readable": 0o640, "world-readable": 0o644}.get(problem, 0o600))
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(SealingKeyError) as refused:
        write_record(folder, "convert")
    assert str(key) in refused.value.args[0] and f"rm {key}" in refused.value.hint
    assert not (folder / ".flux-port-output.json").exists()
    if problem != "folder":  # what the hint says works: a new key, and records again
        key.unlink()
        write_record(folder, "convert")
        assert read_record(folder) is not None
        assert len(key.read_bytes()) == 32 and key.stat().st_mode & 0o777 == 0o600


def test_a_bad_key_stops_a_verb_before_it_writes(state, tmp_path, capsys, tiny2_file):
    state.mkdir(mode=0o700)
    (state / "ownership.key").write_bytes(b"short")
    os.chmod(state / "ownership.key", 0o600)
    out = tmp_path / "out"
    run = run_port(capsys, "convert", tiny2_file, "--out", out, "--json")
    assert run.code == 2, run.err
    doc = json.loads(run.out)
    assert "sealing key" in doc["error"] and "32" in doc["error"] and "rm " in doc["hint"]
    assert leftovers(out) == []


def test_no_place_for_a_key_is_refused_not_a_throwaway_key(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("FLUX_PORT_STATE_DIR", str(blocker / "state"))
    folder = tmp_path / "out"
    folder.mkdir()
    with pytest.raises(SealingKeyError, match="no place to keep the key"):
        write_record(folder, "convert")


# --- port fetch: files put in a folder the user names ---------------------------------------------------------------

def test_fetch_never_replaces_a_file_it_did_not_write(cli, hubs, tmp_path):
    hubs.add_hf(Repo("acme/tiny", tiny_pipeline_files()))
    out = tmp_path / "out"
    out.mkdir()
    mine = out / "model_index.json"
    mine.write_text('{"_class_name": "MyOwnPipeline"}\n')  # the user's own file, under the name the repo uses
    r = cli.run(["fetch", "hf:acme/tiny", "--out", "out"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 2, r
    err = " ".join(r.err.split())
    assert "out/model_index.json: already in" in err and "did not write it" in err  # shown relative to the cwd
    assert mine.read_text() == '{"_class_name": "MyOwnPipeline"}\n'
    assert not hubs.requests("cdn")  # refused before any download


def test_fetch_replaces_a_file_it_wrote_when_the_listing_changes(cli, hubs, tmp_path):
    files = tiny_pipeline_files()
    hubs.add_hf(Repo("acme/tiny", files))
    env = client_env(tmp_path, hubs)
    assert cli.run(["fetch", "hf:acme/tiny", "--out", "out"], env, tmp_path).code == 0
    newer = {**files, "model_index.json": b'{"_class_name": "Flux2KleinPipeline", "v": 2}\n'}
    hubs.add_hf(Repo("acme/tiny", newer))  # a new commit on main
    (tmp_path / "out" / "fetch-manifest.json").unlink()  # no record of the old listing: the file is "unchecked"
    r = cli.run(["fetch", "hf:acme/tiny", "--out", "out"], env, tmp_path)
    assert r.code == 0, r
    assert (tmp_path / "out" / "model_index.json").read_bytes() == newer["model_index.json"]
