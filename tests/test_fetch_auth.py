"""Gated repositories, tokens and mirrors: messages, exit code 3, and where a token may (not) go."""

from __future__ import annotations

from tests.hubserver.harness import cli, client_env, hubs  # noqa: F401  (pytest fixtures)
from tests.hubserver.server import GOOD_TOKEN, Repo, tiny_pipeline_files

WRONG_TOKEN = "hf_wrong_but_secret_value"


def test_gated_repo_without_token_401(cli, hubs, tmp_path):
    hubs.add_hf(Repo("acme/gated", tiny_pipeline_files(), gated=True))
    r = cli.run(["fetch", "hf:acme/gated", "--out", "out"], client_env(tmp_path, hubs), tmp_path)
    assert r.code == 3, r
    assert "acme/gated is gated" in r.err and "(HTTP 401)" in r.err
    assert f"Accept the licence on the repo page {hubs.hub_url}/acme/gated, then set HF_TOKEN" in r.err
    assert "or use --from modelscope" in r.err
    assert "Traceback" not in r.stderr and not (tmp_path / "out").exists()


def test_gated_repo_with_unauthorized_token_403(cli, hubs, tmp_path):
    hubs.add_hf(Repo("acme/gated", tiny_pipeline_files(), gated=True))
    env = client_env(tmp_path, hubs, HF_TOKEN=WRONG_TOKEN)
    r = cli.run(["fetch", "hf:acme/gated", "--out", "out", "--send-token"], env, tmp_path)
    assert r.code == 3, r
    assert "the token sent is not on its authorized list (HTTP 403" in r.err
    assert f"request access on {hubs.hub_url}/acme/gated" in r.err
    assert hubs.log[0].authorization == f"Bearer {WRONG_TOKEN}"   # it was sent, because --send-token
    assert WRONG_TOKEN not in r.stdout + r.stderr                  # ... but never printed


def test_gated_repo_with_good_token_and_json_never_echoes_it(cli, hubs, tmp_path):
    repo = hubs.add_hf(Repo("acme/gated", tiny_pipeline_files(), gated=True))
    env = client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN)
    r = cli.run(["fetch", "hf:acme/gated", "--out", "out", "--send-token", "--json"], env, tmp_path)
    assert r.code == 0, r
    assert r.json["parts"][0]["token_sent"] is True
    assert all(x.authorization == f"Bearer {GOOD_TOKEN}" for x in hubs.requests("hub"))
    assert all(x.authorization is None for x in hubs.requests("cdn"))  # never to the CDN's other origin
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "out").rglob("*.json"))
    assert GOOD_TOKEN not in written + r.stdout + r.stderr
    assert (tmp_path / "out" / "model_index.json").read_bytes() == repo.files["model_index.json"]


def test_token_is_not_sent_to_a_mirror(cli, hubs, tmp_path):
    hubs.add_hf(Repo("acme/tiny", {"a.json": b"{}", "w.safetensors": b"\0" * 1000}))
    env = client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN)
    del env["HF_ENDPOINT"]
    r = cli.run(["fetch", "hf:acme/tiny", "--from", "mirror", "--endpoint", hubs.hub_url, "--out", "out"], env,
                tmp_path)
    assert r.code == 0, r
    assert hubs.log and all(x.authorization is None and x.cookie is None for x in hubs.log)
    assert "is not sent to 127.0.0.1" in r.err and "--send-token" in r.err


def test_gated_repo_on_a_mirror_explains_the_withheld_token(cli, hubs, tmp_path):
    hubs.add_hf(Repo("acme/gated", {"a.json": b"{}"}, gated=True))
    env = client_env(tmp_path, hubs, HF_TOKEN=GOOD_TOKEN)
    r = cli.run(["fetch", "hf:acme/gated", "--out", "out"], env, tmp_path)
    assert r.code == 3, r
    assert "Your Hugging Face token was not sent because 127.0.0.1 is not huggingface.co" in r.err
    assert all(x.authorization is None for x in hubs.log)
