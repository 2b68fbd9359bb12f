"""A secret is never echoed: an argument that holds a credential (a token pasted into --push, a URL with
`user:token@`, a token in a query, a token as a repository name) is refused, and neither the message, the --json
document, nor any file the run wrote repeats the credential. Every verb that takes such an argument is run for real,
in this process; the oracle is a plain substring search over stdout, stderr and every file under the test's folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from porting.errors import PortError

from .helpers import run_port

# a token of the Hugging Face shape (hf_ + 34 letters) and one of no known shape, as ModelScope's may be
HF_SHAPED = "hf_" + "Q" * 10 + "wErTyUiOpAsDfGhJkLzXcVbN"
PLAIN = "s3cr3t-0f-n0-kn0wn-5hape"


def _all_text(tmp_path: Path, *outputs: str) -> str:
    written = [p.read_bytes().decode("utf-8", "replace") for p in tmp_path.rglob("*") if p.is_file()]
    return "\n".join([*outputs, *written])


def _refused(capsys, tmp_path: Path, argv: list[str], secret: str) -> str:
    """Run `port ARGV` (human, then --json); both refuse with exit 2 and never show `secret`. Returns the error."""
    human = run_port(capsys, *argv)
    assert human.code == 2, (human.code, human.out, human.err)
    machine = run_port(capsys, *argv, "--json")
    assert machine.code == 2, (machine.code, machine.out, machine.err)
    error = json.loads(machine.out)["error"]
    text = _all_text(tmp_path, human.out, human.err, machine.out, machine.err)
    assert secret not in text, text
    assert "***" in human.err or "credential" in human.err, human.err  # it says what it refused, redacted
    return error


@pytest.fixture
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", PLAIN)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", PLAIN + "-ms")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)


PUBLISH = ["publish", "--base", "b", "--transformer", "t", "--out", "o"]


@pytest.mark.parametrize("argv", [
    PUBLISH + ["--push", f"https://alice:{PLAIN}@huggingface.co/alice/x"],
    PUBLISH + ["--push", PLAIN],
    PUBLISH + ["--push", f"https://alice:{HF_SHAPED}@huggingface.co/alice/x"],
    PUBLISH + ["--push", HF_SHAPED],
    PUBLISH + ["--push", f"alice/{HF_SHAPED}"],
    PUBLISH + ["--push", "alice/x", "--push-to", "modelscope", "--endpoint", f"https://u:{PLAIN}@modelscope.cn"],
    PUBLISH + ["--push", "alice/x", "--endpoint", f"https://hub.example/?token={PLAIN}"],
    PUBLISH + ["--base-model", HF_SHAPED],
    ["fetch", f"https://alice:{PLAIN}@huggingface.co/alice/x"],
    ["fetch", "hf:alice/x", "--endpoint", f"https://alice:{PLAIN}@huggingface.co"],
    ["fetch", "hf:alice/x", "--endpoint", f"http://127.0.0.1:9/?access_token={HF_SHAPED}"],
    ["inspect", f"https://alice:{HF_SHAPED}@huggingface.co/alice/x"],
], ids=["url-env-token", "env-token", "url-hf-token", "hf-token", "token-as-name", "endpoint-ms", "endpoint-query",
        "base-model", "fetch-url", "fetch-endpoint", "fetch-query", "inspect-url"])
def test_a_credential_in_an_argument_is_never_echoed(capsys, tmp_path, monkeypatch, token_env, argv):
    monkeypatch.chdir(tmp_path)
    secret = PLAIN if any(PLAIN in a for a in argv) else HF_SHAPED
    _refused(capsys, tmp_path, argv, secret)


def test_a_push_target_holding_a_token_says_where_a_token_goes(capsys, tmp_path, monkeypatch, token_env):
    monkeypatch.chdir(tmp_path)
    error = _refused(capsys, tmp_path, PUBLISH + ["--push", f"https://alice:{PLAIN}@huggingface.co/alice/x"], PLAIN)
    assert error.startswith("--push 'https://***@huggingface.co/alice/x'"), error
    doc = json.loads(run_port(capsys, *PUBLISH, "--push", HF_SHAPED, "--json").out)
    assert "HF_TOKEN" in doc["hint"] and HF_SHAPED not in json.dumps(doc)


def test_a_batch_jobs_file_with_a_token_in_its_push_target(capsys, tmp_path, monkeypatch, token_env):
    """The jobs file's value is echoed in the refusal (file, job, option): redacted there too, and nothing made."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base").mkdir()
    (tmp_path / "a.safetensors").write_bytes(b"")
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[defaults]\nbase = "{tmp_path / "base"}"\n\n[[job]]\nname = "a"\n'
                    f'source = "{tmp_path / "a.safetensors"}"\nsteps = ["convert", "validate", "publish"]\n'
                    f'publish = {{ push = "https://alice:{PLAIN}@huggingface.co/alice/x" }}\n')
    text = jobs.read_text()
    jobs.unlink()  # the jobs file itself holds the secret: kept outside the folder searched
    outside = tmp_path.parent / f"{tmp_path.name}-jobs.toml"
    outside.write_text(text)
    _refused(capsys, tmp_path, ["batch", str(outside), "--out", str(tmp_path / "out")], PLAIN)
    assert not (tmp_path / "out").exists()


def test_every_error_is_redacted_as_it_is_made_and_as_it_is_changed(monkeypatch):
    from porting.errors import redact

    monkeypatch.setenv("HF_TOKEN", PLAIN)
    err = PortError(f"cannot reach https://x:{PLAIN}@h/a", hint=f"token {HF_SHAPED}", details=f"Bearer {PLAIN}")
    assert PLAIN not in f"{err} {err.message} {err.hint} {err.details} {err.args}"
    err.hint = f"{err.hint} and ?sig={PLAIN}"
    assert PLAIN not in err.hint and HF_SHAPED not in err.hint
    assert redact("https://huggingface.co/alice/x") == "https://huggingface.co/alice/x"  # nothing to remove
    assert redact("ssh://git@example.org/x") == "ssh://***@example.org/x"
