"""`port publish --push`: the real huggingface_hub client against the local Hub (tests/hubserver) — what lands is
byte-identical and checked, a second push sends nothing, an interrupted push resumes, refusals send nothing, a
hub that stores other bytes is caught, and the token never shows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.hubserver.harness import CliRunner, cli, client_env, hubs, local_files, wait_until  # noqa: F401
from porting.ownership import RECORD
from tests.hubserver.server import GOOD_TOKEN, OTHER_TOKEN, FakeHubs, Repo

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
