"""`port fetch modelscope:...` with the real modelscope client (modelscope_hub) against a local ModelScope."""

from __future__ import annotations

import json
import os

from tests.hubserver.harness import MiB, cli, client_env, hubs, local_files, wait_until  # noqa: F401  (fixtures)
from tests.hubserver.server import GOOD_TOKEN, Repo, sha256, tiny_pipeline_files


def test_modelscope_snapshot_with_include(cli, hubs, tmp_path):
    repo = hubs.add_ms(Repo("acme/tiny", tiny_pipeline_files()))
    r = cli.run(["fetch", "modelscope:acme/tiny", "--out", "out", "--exclude", "flux-2-klein-tiny.safetensors",
                 "--json"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 0, r
    got = local_files(tmp_path / "out")
    manifest = json.loads(got.pop("fetch-manifest.json"))
    expected = {p: d for p, d in repo.files.items() if p != "flux-2-klein-tiny.safetensors"}
    assert got == expected
    assert manifest["hub"] == "modelscope" and manifest["revision"] == "master" and manifest["commit"] is None
    assert all(f["verified_by"] == "sha256" and f["sha256"] == sha256(repo.files[f["path"]])
               for f in manifest["files"])
    # one listing, then one request per selected file, always with an explicit revision
    gets = hubs.requests("ms", "GET", contains="/repo?")
    assert len(gets) == len(expected) and all("Revision=master" in g.path for g in gets)
    assert not hubs.requests("hub") and not hubs.requests("cdn")


def test_modelscope_gated_without_token(cli, hubs, tmp_path):
    hubs.add_ms(Repo("acme/private", {"a.json": b"{}"}, gated=True))
    r = cli.run(["fetch", "modelscope:acme/private", "--out", "out"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 3, r
    assert "acme/private on 127.0.0.1 needs a ModelScope token (HTTP 401)" in r.err
    assert "MODELSCOPE_API_TOKEN" in r.err


def test_modelscope_token_only_with_send_token(cli, hubs, tmp_path):
    hubs.add_ms(Repo("acme/private", {"a.json": b"{}"}, gated=True))
    env = client_env(tmp_path, hubs, MODELSCOPE_API_TOKEN=GOOD_TOKEN)
    r = cli.run(["fetch", "modelscope:acme/private", "--out", "out"], env, tmp_path)
    assert r.code == 3, r                                      # 127.0.0.1 is not modelscope.cn: withheld
    assert "was not sent" in r.err and GOOD_TOKEN not in r.stdout + r.stderr
    assert all(x.authorization is None and x.cookie is None for x in hubs.log)
    r = cli.run(["fetch", "modelscope:acme/private", "--out", "out", "--send-token"], env, tmp_path)
    assert r.code == 0, r
    assert (tmp_path / "out" / "a.json").read_bytes() == b"{}"
    assert GOOD_TOKEN not in (tmp_path / "out" / "fetch-manifest.json").read_text()


def test_modelscope_missing_repo_and_file(cli, hubs, tmp_path):
    hubs.add_ms(Repo("acme/tiny", {"a.json": b"{}"}))
    r = cli.run(["fetch", "modelscope:acme/nope", "--out", "out"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 2, r
    assert "ModelScope (127.0.0.1) has no acme/nope at revision 'master'" in r.err
    r = cli.run(["fetch", "modelscope:acme/tiny", "--file", "b.json", "--out", "out"], client_env(tmp_path, hubs),
                tmp_path)
    assert r.code == 2, r
    assert "b.json is not in acme/tiny at master" in r.err


def test_modelscope_killed_download_resumes(cli, hubs, tmp_path):
    big = os.urandom(6 * MiB)
    hubs.add_ms(Repo("acme/big", {"big.safetensors": big}))
    hubs.stall_after["big.safetensors"] = 3 * MiB
    env = client_env(tmp_path, hubs)
    partial = tmp_path / "out" / "big.safetensors.incomplete"
    running = cli.start(["fetch", "modelscope:acme/big", "--out", "out"], env, tmp_path)
    assert hubs.stalled.wait(60)
    wait_until(lambda: partial.exists() and partial.stat().st_size >= 2 * MiB)
    running.kill()
    assert running.wait().code == -9
    have = partial.stat().st_size

    del hubs.stall_after["big.safetensors"]
    hubs.log.clear()
    r = cli.run(["fetch", "modelscope:acme/big", "--out", "out"], env, tmp_path)
    assert r.code == 0, r
    (get,) = hubs.requests("ms", "GET", contains="FilePath=big.safetensors")
    assert get.range == f"bytes={have}-" and get.status == 206 and get.sent == len(big) - have
    assert (tmp_path / "out" / "big.safetensors").read_bytes() == big
