"""`port publish --push`: the real huggingface_hub client against the local Hub (tests/hubserver) — what lands is
byte-identical and checked, a second push sends nothing, an interrupted push resumes, refusals send nothing, a
hub that stores other bytes is caught, and the token never shows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from porting.ownership import RECORD
from tests.hubserver.harness import CliRunner, cli, client_env, hubs, local_files, wait_until  # noqa: F401
from tests.hubserver.server import GOOD_TOKEN, OTHER_TOKEN, FakeHubs, Repo
from tests.test_known_digests import edit_in_place_keeping_size_and_mtime

REPO = "alice/tiny-klein-ft"
WRONG_TOKEN = "hf_wrong_but_secret_value"


def publish_argv(port: dict, out: Path, *extra: str) -> list[str]:
    return ["publish", "--base", str(port["base"]), "--transformer", str(port["transformer"]),
            "--report", str(port["pass"]), "--out", str(out), "--base-model", "black-forest-labs/FLUX.2-klein-4B",
            *extra]


def push(cli: CliRunner, hubs: FakeHubs, port: dict, tmp_path: Path, *extra: str, token: str | None = GOOD_TOKEN,
         out: str = "pub", **env: str):
    argv = publish_argv(port, tmp_path / out, "--push", REPO, "--send-token", "--json", *extra)
    e = client_env(tmp_path, hubs, **({"HF_TOKEN": token} if token else {}), **env)
    return cli.run(argv, e, tmp_path)


def published(folder: Path) -> dict[str, bytes]:
    """The folder's files as the hub should hold them (the local ownership seal stays local)."""
    return {p: d for p, d in local_files(folder).items() if p != RECORD}


def assert_no_token(*texts: str) -> None:
    for text in texts:
        for secret in (GOOD_TOKEN, WRONG_TOKEN, OTHER_TOKEN):
            assert secret not in text


def test_push_lands_byte_identical_and_checked(cli, hubs, port, tmp_path):
    r = push(cli, hubs, port, tmp_path)
    assert r.code == 0, r
    doc = r.json["push"]
    folder = tmp_path / "pub"
    local = published(folder)
    repo = hubs.hf[REPO]
    assert repo.private and hubs.created == [REPO]
    files_rev, card_rev = doc["revision"], doc["card_revision"]
    assert repo.history[files_rev] == local                      # the revision named holds exactly the folder
    assert {p: d for p, d in repo.files.items() if p != "README.md"} == {p: d for p, d in local.items()
                                                                          if p != "README.md"}
    card = repo.files["README.md"].decode()
    assert card.startswith(local["README.md"].decode()) and f"revision `{files_rev}`" in card
    assert repo.branches["main"] == card_rev and len(repo.commits) == 2
    header = repo.commits[0][0]
    assert header["summary"].startswith("flux-port ") and "validation pass" in header["summary"]
    assert doc["checked_files"] == len(local) and sorted(doc["uploaded_files"]) == sorted(local)
    assert_no_token(r.stdout, r.stderr, (folder / "manifest.json").read_text())


def writes(hubs: FakeHubs, since: int = 0) -> list[str]:
    """Every request after `since` that could send content or create something."""
    return [f"{r.method} {r.path}" for r in hubs.log[since:] if r.method in ("POST", "PUT")]


@pytest.mark.slow  # idempotence is also held in the default run by the ModelScope push test
def test_second_push_sends_nothing_and_says_so(cli, hubs, port, tmp_path):
    assert push(cli, hubs, port, tmp_path).code == 0
    first = hubs.hf[REPO].branches["main"]
    mark = len(hubs.log)
    r = push(cli, hubs, port, tmp_path, "--force")
    assert r.code == 0, r
    doc = r.json["push"]
    assert doc["nothing_uploaded"] and doc["uploaded_files"] == [] and doc["uploaded_bytes"] == 0
    assert writes(hubs, mark) == [] and sum(x.received for x in hubs.log[mark:]) == 0
    argv = [a for a in publish_argv(port, tmp_path / "pub", "--push", REPO, "--send-token", "--force")]
    text = cli.run(argv, client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN), tmp_path)
    assert text.code == 0, text
    assert "nothing to upload" in text.err and "nothing uploaded: the hub already holds these files" in text.stdout
    assert writes(hubs, mark) == []
    assert hubs.hf[REPO].branches["main"] == first and len(hubs.hf[REPO].commits) == 2
    assert doc["revision"] == hubs.hf[REPO].commits[0][1]        # the card still names the files' revision


def test_changed_folder_uploads_only_what_changed(cli, hubs, port, tmp_path):
    assert push(cli, hubs, port, tmp_path).code == 0
    mark = len(hubs.log)
    argv = ["publish", "--base", str(port["base"]), "--transformer", str(port["transformer"]), "--report",
            str(port["pass"]), "--out", str(tmp_path / "pub"), "--force", "--base-model", "acme/other-base",
            "--push", REPO, "--send-token", "--json"]
    r = cli.run(argv, client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN), tmp_path)
    assert r.code == 0, r
    doc = r.json["push"]
    assert doc["uploaded_files"] == ["README.md", "manifest.json"] and not doc["nothing_uploaded"]
    assert not [w for w in writes(hubs, mark) if "lfs" in w]      # no weights sent again
    assert len(hubs.hf[REPO].commits) == 4                         # one commit of the change, one stamping the card
    assert hubs.hf[REPO].history[doc["revision"]] == published(tmp_path / "pub")


def kill_mid_upload(cli: CliRunner, hubs: FakeHubs, port: dict, tmp_path: Path, argv: list[str],
                    env: dict[str, str]) -> str:
    """Run a push whose transformer weights upload hangs, kill it once every other LFS file is stored; returns the
    sha256 of the file it did not finish."""
    held = hashlib.sha256((port["transformer"] / "diffusion_pytorch_model.safetensors").read_bytes()).hexdigest()
    hubs.hold_uploads.add(held)
    running = cli.start(argv, env, tmp_path)

    def others_stored() -> bool:
        stored = {hashlib.sha256(d).hexdigest() for p, d in published(tmp_path / "pub").items()
                  if p.endswith(".safetensors")} - {held}
        return hubs.stalled.is_set() and stored <= set(hubs.lfs_store)

    wait_until(lambda: (tmp_path / "pub").exists() and others_stored())
    running.kill()
    running.wait()
    hubs.hold_uploads.clear()
    return held


def test_interrupted_push_resumes_without_sending_stored_files_again(cli, hubs, port, tmp_path):
    argv = publish_argv(port, tmp_path / "pub", "--push", REPO, "--send-token")
    env = client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN)
    held = kill_mid_upload(cli, hubs, port, tmp_path, argv, env)
    assert hubs.hf[REPO].commits == []                             # killed before its commit
    mark = len(hubs.log)
    r = cli.run(argv + ["--force", "--json"], env, tmp_path)
    assert r.code == 0, r
    puts = [x.path for x in hubs.log[mark:] if x.method == "PUT"]
    assert puts == [f"/lfs-upload/{held}"], puts                   # only the file the killed run had not stored
    assert hubs.hf[REPO].history[r.json["push"]["revision"]] == published(tmp_path / "pub")


def test_tampered_upload_is_caught_naming_the_file(cli, hubs, port, tmp_path):
    hubs.tamper.add("transformer/diffusion_pytorch_model.safetensors")
    r = push(cli, hubs, port, tmp_path)
    assert r.code == 1, r
    assert "transformer/diffusion_pytorch_model.safetensors: sha256" in r.err
    assert "what landed is not what was validated" in r.err
    assert len(hubs.hf[REPO].commits) == 1                         # the card was not stamped with that revision


@pytest.mark.parametrize("case", ["no-token", "wrong-token", "someone-else", "other-account", "gate", "name",
                                  "skip-validation", "third-party-endpoint"])
def test_refusals_send_nothing_and_create_nothing(cli, hubs, port, tmp_path, case):
    hubs.add_hf(Repo("mallory/theirs", {"README.md": b"# theirs\n"}))
    extra: list[str] = []
    token: str | None = GOOD_TOKEN
    repo = REPO
    if case == "no-token":
        token = None
    elif case == "wrong-token":
        token = WRONG_TOKEN
    elif case == "someone-else":
        repo = "mallory/theirs"
    elif case == "other-account":
        token = OTHER_TOKEN
    elif case == "name":
        repo = "just-a-name"
    argv = ["publish", "--base", str(port["base"]), "--transformer", str(port["transformer"]), "--report",
            str(port["fail" if case == "gate" else "pass"]), "--out", str(tmp_path / "pub"), "--push", repo, "--json",
            *([] if case == "third-party-endpoint" else ["--send-token"]),
            *(["--skip-validation"] if case == "skip-validation" else []), *extra]
    env = client_env(tmp_path, hubs, **({"HF_TOKEN": token} if token else {}))
    r = cli.run(argv, env, tmp_path)
    expected = {"gate": 1, "name": 2, "skip-validation": 2}.get(case, 3)
    assert r.code == expected, r
    assert r.json["exit_code"] == expected
    assert writes(hubs) == [] and hubs.created == [] and REPO not in hubs.hf
    assert_no_token(r.stdout, r.stderr)
    if case != "gate":
        assert not (tmp_path / "pub").exists()                     # refused before publish did any work
    if case in ("no-token", "name", "skip-validation", "third-party-endpoint"):
        assert hubs.log == []                                      # not even a read
    message = r.json["error"] + " " + (r.json.get("hint") or "")
    assert {"no-token": "No Hugging Face token found", "wrong-token": "rejected the token (HTTP 401)",
            "someone-else": "belongs to 'mallory'", "other-account": "belongs to 'alice'",
            "gate": "validation", "name": "not a repository id of the form ORG/NAME",
            "skip-validation": "--skip-validation", "third-party-endpoint": "--send-token"}[case] in message


def test_token_never_printed_logged_or_written(cli, hubs, port, tmp_path):
    r = push(cli, hubs, port, tmp_path, token=GOOD_TOKEN)
    assert r.code == 0, r
    bad = push(cli, hubs, port, tmp_path, token=WRONG_TOKEN, out="pub2")
    assert bad.code == 3
    written = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())
    assert_no_token(r.stdout, r.stderr, bad.stdout, bad.stderr, written, json.dumps(r.json))
    assert hubs.requests(method="POST")[0].authorization == f"Bearer {GOOD_TOKEN}"   # it was sent, to the hub


@pytest.mark.slow  # a fresh interpreter (the client reads HF_HUB_DISABLE_XET at import): 4-10 s on 2 busy cores
def test_xet_path_refused_by_an_endpoint_without_xet(hubs, port, tmp_path):
    """hf_xet is installed: without HF_HUB_DISABLE_XET the client uploads through Xet, has no fallback, and this
    server (like any endpoint without Xet storage) refuses it. A fresh interpreter, since the client reads the
    setting when it is imported."""
    pytest.importorskip("hf_xet", reason="the Xet path exists only with hf_xet installed")
    runner = CliRunner(spawn=True)
    try:
        env = client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN)
        env.pop("HF_HUB_DISABLE_XET")
        r = runner.run(publish_argv(port, tmp_path / "pub", "--push", REPO, "--send-token", "--json"), env, tmp_path)
    finally:
        runner.close()
    assert r.code == 2, r
    assert "Xet" in r.json["error"] and "HF_HUB_DISABLE_XET=1" in r.json["hint"]
    assert hubs.requests(contains="/xet-write-token/") and hubs.hf[REPO].commits == []
    assert not hubs.requests(method="PUT")
    assert_no_token(r.stdout, r.stderr)


def ms_push(cli: CliRunner, hubs: FakeHubs, port: dict, tmp_path: Path, *extra: str, token: str = GOOD_TOKEN):
    argv = publish_argv(port, tmp_path / "pub", "--push", REPO, "--push-to", "modelscope", "--send-token", "--json",
                        *extra)
    return cli.run(argv, client_env(tmp_path, hubs, MODELSCOPE_API_TOKEN=token), tmp_path)


def test_modelscope_push_lands_tagged_checked_and_idempotent(cli, hubs, port, tmp_path):
    r = ms_push(cli, hubs, port, tmp_path)
    assert r.code == 0, r
    doc = r.json["push"]
    repo = hubs.ms[REPO]
    local = published(tmp_path / "pub")
    assert repo.private and hubs.created == [f"ms:{REPO}"] and REPO not in hubs.hf
    tag = doc["revision"]
    manifest_sha = hashlib.sha256(local["manifest.json"]).hexdigest()
    assert tag == f"flux-port-{manifest_sha[:12]}"
    assert repo.history[repo.branches[tag]] == local               # the tag holds exactly the folder
    card = repo.files["README.md"].decode()
    assert card.startswith(local["README.md"].decode()) and f"revision `{tag}`" in card
    assert {p: d for p, d in repo.files.items() if p != "README.md"} == {p: d for p, d in local.items()
                                                                          if p != "README.md"}
    assert hubs.requests(server="ms", method="PUT")                # weights went through the LFS blob upload
    assert not (tmp_path / "pub" / ".ms_upload_cache").exists()    # the published folder is left as it was
    mark = len(hubs.log)
    again = ms_push(cli, hubs, port, tmp_path, "--force")
    assert again.code == 0, again
    assert again.json["push"]["nothing_uploaded"] and again.json["push"]["revision"] == tag
    assert writes(hubs, mark) == []
    assert_no_token(r.stdout, r.stderr, again.stdout, again.stderr)


def test_modelscope_refusals_and_tamper(cli, hubs, port, tmp_path):
    bad = ms_push(cli, hubs, port, tmp_path, token=WRONG_TOKEN)
    assert bad.code == 3 and "rejected the token (HTTP 401)" in bad.json["error"], bad
    other = ms_push(cli, hubs, port, tmp_path, token=OTHER_TOKEN)
    assert other.code == 3 and "belongs to 'alice'" in other.json["error"], other
    assert writes(hubs) == [] and hubs.created == [] and not (tmp_path / "pub").exists()
    hubs.tamper.add("vae/diffusion_pytorch_model.safetensors")
    r = ms_push(cli, hubs, port, tmp_path)
    assert r.code == 1, r
    assert r.json["error"].startswith("vae/diffusion_pytorch_model.safetensors: sha256")
    assert not [t for t in hubs.ms[REPO].branches if t.startswith("flux-port-")]   # nothing pinned
    assert_no_token(bad.stdout, bad.stderr, other.stdout, other.stderr, r.stdout, r.stderr)


BATCH_VALIDATE = 'validate = { resolution = 64, text-len = 32, timesteps = "0.5", intrinsic = "emulated" }'


def _batch(tmp_path: Path, hubs: FakeHubs, jobs: str, **env: str):
    import subprocess
    import sys

    (tmp_path / "jobs.toml").write_text(jobs)
    e = {**client_env(tmp_path, hubs, **env), "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-m", "porting", "batch", "jobs.toml", "--out", "out", "--json"],
                          env=e, cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # a batch of two jobs (convert, validate, publish + push) in fresh worker processes: ~12 s
def test_batch_publish_step_pushes_each_job(hubs, port, tmp_path):
    from porting.demo.tiny import TINY_FLUX2, write_random_checkpoint

    for seed, name in ((11, "one"), (12, "two")):
        write_random_checkpoint(tmp_path / f"{name}.safetensors", TINY_FLUX2, seed=seed)
    jobs = (f'[defaults]\nbase = "{port["base"]}"\nsteps = ["convert", "validate", "publish"]\n{BATCH_VALIDATE}\n'
            'publish = { push = "alice/{job}", send-token = true }\n\n'
            '[[job]]\nname = "one"\nsource = "one.safetensors"\n\n[[job]]\nname = "two"\nsource = "two.safetensors"\n')
    r = _batch(tmp_path, hubs, jobs, HF_TOKEN=GOOD_TOKEN)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for job in doc["jobs"]:
        repo = hubs.hf[f"alice/{job['name']}"]
        local = published(tmp_path / "out" / job["name"] / "published")
        files_rev = repo.commits[0][1]
        assert repo.history[files_rev] == local and repo.private
        assert job["pushed"] == f"hf:alice/{job['name']}@{files_rev}"
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*.json"))
    written += "".join(p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*.md"))
    assert_no_token(r.stdout, r.stderr, written)


@pytest.mark.parametrize("push, why", [("no-slash", "not a repository id"), ("alice/same", "each job needs its own")])
def test_batch_refuses_a_bad_push_before_any_work(hubs, tmp_path, push, why):
    (tmp_path / "a.safetensors").write_bytes(b"x")
    jobs = (f'[defaults]\nsteps = ["convert", "publish"]\npublish = {{ push = "{push}" }}\n\n'
            '[[job]]\nname = "one"\nsource = "a.safetensors"\n\n[[job]]\nname = "two"\nsource = "a.safetensors"\n')
    r = _batch(tmp_path, hubs, jobs)
    assert r.returncode == 2, r.stderr
    assert why in json.loads(r.stdout)["error"] and not (tmp_path / "out").exists() and hubs.log == []


@pytest.mark.slow  # a resume variant; test_interrupted_push_resumes_without_sending_stored_files_again stays
def test_push_stopped_before_the_card_commit_resumes_with_the_card_only(cli, hubs, port, tmp_path):
    hubs.fail_commits.append("flux-port: model card")
    r = push(cli, hubs, port, tmp_path)
    assert r.code == 4, r                                          # the hub failed: network / server kind
    assert "resumes the upload" in r.json["hint"] and "--force" in r.json["hint"]
    files_rev = hubs.hf[REPO].commits[0][1]
    mark = len(hubs.log)
    again = push(cli, hubs, port, tmp_path, "--force")
    assert again.code == 0, again
    doc = again.json["push"]
    assert doc["revision"] == files_rev and doc["uploaded_files"] == []
    assert not [w for w in writes(hubs, mark) if "lfs" in w]
    assert len(hubs.hf[REPO].commits) == 2 and hubs.hf[REPO].commits[1][0]["summary"].startswith("flux-port: model")
    assert f"revision `{files_rev}`" in hubs.hf[REPO].files["README.md"].decode()


def test_repository_with_files_flux_port_did_not_push_is_refused(cli, hubs, port, tmp_path):
    hubs.add_hf(Repo(REPO, {"README.md": b"# my other model\n", "model.safetensors": b"\0" * 64}))
    r = push(cli, hubs, port, tmp_path)
    assert r.code == 2, r
    assert "already holds 2 file(s) that port publish did not upload" in r.json["error"]
    assert writes(hubs) == [] and hubs.hf[REPO].files["README.md"] == b"# my other model\n"


def test_explicit_endpoint_and_push_options_without_push(cli, hubs, port, tmp_path):
    argv = publish_argv(port, tmp_path / "pub", "--push", REPO, "--endpoint", hubs.hub_url + "/", "--send-token",
                        "--json")
    env = client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN)
    env.pop("HF_ENDPOINT")
    r = cli.run(argv, env, tmp_path)
    assert r.code == 0 and r.json["push"]["endpoint"] == hubs.hub_url, r
    lone = cli.run(publish_argv(port, tmp_path / "p2", "--public", "--json"), env, tmp_path)
    assert lone.code == 2 and "only apply with --push" in lone.json["error"], lone


def test_plain_lfs_path_with_xet_disabled(cli, hubs, port, tmp_path):
    r = push(cli, hubs, port, tmp_path, HF_HUB_DISABLE_XET="1")
    assert r.code == 0, r
    puts = hubs.requests(method="PUT")
    lfs = [p for p in published(tmp_path / "pub") if p.endswith(".safetensors")]
    assert len(puts) == len(lfs) and all(p.path.startswith("/lfs-upload/") for p in puts)
    assert not hubs.requests(contains="xet")


def test_folder_changed_after_publish_is_refused(port, tmp_path):
    from porting.errors import CheckFailed
    from porting.hub.push.identity import local_identity
    from porting.pipeline.publish import publish

    out = tmp_path / "pub"
    publish(port["base"], port["transformer"], out, report=port["pass"])
    local_identity(out)
    with open(out / "vae" / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(CheckFailed, match="vae/config.json"):
        local_identity(out)
    (out / "vae" / "config.json").unlink()
    (out / "notes.txt").write_text("added by hand")
    with pytest.raises(CheckFailed, match="missing"):
        local_identity(out)


@pytest.mark.slow  # a resume variant on ModelScope; the Hub's stays in the default run
def test_modelscope_interrupted_push_resumes(cli, hubs, port, tmp_path):
    argv = publish_argv(port, tmp_path / "pub", "--push", REPO, "--push-to", "modelscope", "--send-token")
    env = client_env(tmp_path, hubs, MODELSCOPE_API_TOKEN=GOOD_TOKEN)
    held = kill_mid_upload(cli, hubs, port, tmp_path, argv, env)
    mark = len(hubs.log)
    r = cli.run(argv + ["--force", "--json"], env, tmp_path)
    assert r.code == 0, r
    puts = [x.path for x in hubs.log[mark:] if x.method == "PUT"]
    assert puts == [f"/ms-blob/{held}"], puts
    repo = hubs.ms[REPO]
    assert repo.history[repo.branches[r.json["push"]["revision"]]] == published(tmp_path / "pub")


@pytest.mark.parametrize("hub", ["hf", pytest.param("modelscope", marks=pytest.mark.slow)])  # one in the default run
def test_an_endpoint_that_never_answers_is_exit_4_not_a_hang(cli, hubs, port, tmp_path, hub):
    silent = hubs.silent_url()
    argv = publish_argv(port, tmp_path / "pub", "--push", REPO, "--push-to", hub, "--endpoint", silent,
                        "--send-token", "--timeout", "1", "--json")
    env = client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN, MODELSCOPE_API_TOKEN=GOOD_TOKEN,
                     MODELSCOPE_API_MAX_RETRIES="1")
    r = cli.run(argv, env, tmp_path, timeout=60)
    assert r.code == 4, r
    assert "127.0.0.1" in r.json["error"] and not (tmp_path / "pub").exists()
    assert_no_token(r.stdout, r.stderr)


@pytest.mark.slow  # an interruption variant; the interrupted-push resume stays in the default run
def test_ctrl_c_during_the_upload_names_the_resume(cli, hubs, port, tmp_path):
    import os
    import signal

    held = hashlib.sha256((port["transformer"] / "diffusion_pytorch_model.safetensors").read_bytes()).hexdigest()
    hubs.hold_uploads.add(held)
    argv = publish_argv(port, tmp_path / "pub", "--push", REPO, "--send-token", "--timeout", "2", "--json")
    running = cli.start(argv, client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN), tmp_path)
    wait_until(hubs.stalled.is_set)
    os.kill(running.pid, signal.SIGINT)
    hubs.hold_uploads.clear()
    hubs.release.set()  # the held request ends; the client waits 1 s before its retry, long before SIGINT lands
    r = running.wait()
    assert r.code == 130, r
    assert r.json["error"].startswith(f"Interrupted during the upload to hf:{REPO}") and "--force" in r.json["hint"]
    assert hubs.hf[REPO].commits == [] and (tmp_path / "pub" / "manifest.json").is_file()


# --- an identity is never stale: a file edited in place, its size and modification time put back --------------

def _own_port(port: dict, tmp_path: Path, monkeypatch) -> tuple[Path, Path, dict[str, str]]:
    """A transformer converted here (its records in this test's state folder, which the CLI children share) and a
    passing report for it; returns (transformer, report, the state variable for the children)."""
    from porting.engine.convert import convert
    from tests.tinyport import write_report

    state = {"FLUX_PORT_STATE_DIR": str(tmp_path / "state")}
    monkeypatch.setenv("FLUX_PORT_STATE_DIR", state["FLUX_PORT_STATE_DIR"])
    result = convert(port["source"], tmp_path / "transformer", strict=True)
    return tmp_path / "transformer", write_report(tmp_path / "reports", result.weights_sha256), state


def _argv(port: dict, transformer: Path, report: Path, out: Path, *extra: str) -> list[str]:
    return ["publish", "--base", str(port["base"]), "--transformer", str(transformer), "--report", str(report),
            "--out", str(out), "--base-model", "black-forest-labs/FLUX.2-klein-4B", "--json", *extra]


def test_an_edit_in_place_is_refused_at_the_gate_locally_and_on_push(cli, hubs, port, tmp_path, monkeypatch):
    """After convert and validate, the weights edited in place with size and mtime kept: publish and publish --push
    refuse at the gate (exit 1), nothing is written or sent; the records do not describe the file any more."""
    transformer, report, state = _own_port(port, tmp_path, monkeypatch)
    edit_in_place_keeping_size_and_mtime(transformer / "diffusion_pytorch_model.safetensors")
    env = client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN, **state)
    local = cli.run(_argv(port, transformer, report, tmp_path / "pub"), env, tmp_path)
    assert local.code == 1, local
    assert "weights changed since port convert wrote them" in local.json["error"]
    pushed = cli.run(_argv(port, transformer, report, tmp_path / "pub", "--push", REPO, "--send-token"), env,
                     tmp_path)
    assert pushed.code == 1, pushed
    assert "weights changed since port convert wrote them" in pushed.json["error"]
    assert "resumes the upload" not in (pushed.json["hint"] or "")
    assert not (tmp_path / "pub").exists() and writes(hubs) == [] and REPO not in hubs.hf


def _lie(files: list[Path]) -> None:
    """Injected fault: each file's sealed record rewritten to describe the file as it is now, while keeping what it
    said of the bytes before (a record that lies: what the change time check stops, short of a forged record)."""
    import os

    from porting.ownership import read_state_record, write_state_record

    before = {f: read_state_record("digests", os.stat(f)) for f in files}
    edit_in_place_keeping_size_and_mtime(files[0])
    for f, doc in before.items():
        assert doc is not None
        st = os.stat(f)
        facts = {**doc["file"], "device": st.st_dev, "inode": st.st_ino, "size": st.st_size,
                 "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}
        write_state_record("digests", st, {k: v for k, v in {**doc, "file": facts}.items() if k not in ("seal",
                                                                                                       "tool")})


def test_a_hub_refusing_a_recorded_digest_names_the_changed_file(cli, hubs, port, tmp_path, monkeypatch):
    """The recorded sha256 is a hint handed to the hub as the LFS oid. A record that lies (the file changed in place
    after it was hashed) makes the hub refuse the upload; flux-port hashes the file again and names the true cause,
    exit 1 with no "--force resumes" (that would fail the same way forever), and drops the record, so the rerun is
    refused at the gate."""
    transformer, report, state = _own_port(port, tmp_path, monkeypatch)
    env = client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN, **state)
    first = cli.run(_argv(port, transformer, report, tmp_path / "pub"), env, tmp_path)
    assert first.code == 0, first  # publish took each file's sha256 and recorded it
    weights = transformer / "diffusion_pytorch_model.safetensors"
    _lie([weights])
    argv = _argv(port, transformer, report, tmp_path / "pub", "--push", REPO, "--send-token", "--force")
    r = cli.run(argv, env, tmp_path)
    assert r.code == 1, r
    assert "diffusion_pytorch_model.safetensors: changed since it was validated and published" in r.json["error"]
    assert hashlib.sha256(weights.read_bytes()).hexdigest() in r.json["error"]
    assert "port validate" in r.json["hint"] and "resumes the upload" not in r.json["hint"]
    assert hubs.hf[REPO].commits == []
    again = cli.run(argv, env, tmp_path)
    assert again.code == 1, again
    assert "weights changed since port convert wrote them" in again.json["error"]
    assert hubs.hf[REPO].commits == []
