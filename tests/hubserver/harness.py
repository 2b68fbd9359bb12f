"""pytest fixtures: `hubs` (fresh fake servers per test), `cli` (runs `port ...` in a child process), `client_env`.

Children are forked from a server process that imported torch once (zygote.py), which keeps each CLI run well
under a second; FLUX_PORT_TEST_SPAWN=1 starts a fresh interpreter per run instead (slower, same results).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from .server import FakeHubs

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
MiB = 1 << 20


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def wait_until(condition: Any, timeout: float = 60.0) -> None:
    """Readiness check: poll a condition on the file system until it holds (fails the test after `timeout`)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def err(self) -> str:
        """stderr with line wrapping undone (the console wraps long messages at its width)."""
        return " ".join(self.stderr.split())

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)

    def __str__(self) -> str:
        return f"exit {self.code} after {self.seconds:.1f} s\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


class Running:
    def __init__(self, runner: "CliRunner", pid: int, out: Path, err: Path, started: float, proc: Any = None):
        self.runner, self.pid, self._out, self._err, self._started, self._proc = runner, pid, out, err, started, proc

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float = 120) -> Result:
        if self._proc is not None:
            code = self._proc.wait(timeout)
        else:
            code = self.runner._reply(timeout)["code"]
        return Result(code, self._out.read_text(), self._err.read_text(), time.monotonic() - self._started)


class CliRunner:
    def __init__(self, spawn: bool) -> None:
        self.spawn = spawn
        self._tmp = tempfile.TemporaryDirectory(prefix="fetch-cli-")
        self._n = 0
        self._zygote: subprocess.Popen[str] | None = None
        if not spawn:
            self._zygote = subprocess.Popen(
                [sys.executable, "-m", "hubserver.zygote"], cwd=TESTS_DIR, text=True, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env={**base_env(Path(self._tmp.name)), "PYTHONPATH": str(REPO_ROOT)})
            ready = self._reply(120)
            assert "ready" in ready, ready

    def _reply(self, timeout: float) -> dict[str, Any]:
        assert self._zygote is not None and self._zygote.stdout is not None
        ready, _, _ = select.select([self._zygote.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"the CLI child did not finish within {timeout} s")
        line = self._zygote.stdout.readline()
        if not line:
            raise RuntimeError("the fork server exited")
        return json.loads(line)

    def start(self, argv: list[str], env: dict[str, str], cwd: Path,
              patches: dict[str, Any] | None = None) -> Running:
        self._n += 1
        out = Path(self._tmp.name) / f"{self._n}.out"
        err = Path(self._tmp.name) / f"{self._n}.err"
        req = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err),
               "patches": patches or {}}
        started = time.monotonic()
        if self.spawn:
            req_file = Path(self._tmp.name) / f"{self._n}.json"
            req_file.write_text(json.dumps(req))
            # this checkout's `porting` (a worktree's), not whichever one the environment has installed
            child_env = {**env, "PYTHONPATH": os.pathsep.join((str(TESTS_DIR), str(REPO_ROOT)))}
            with open(out, "w") as o, open(err, "w") as e:
                proc = subprocess.Popen([sys.executable, "-m", "hubserver.runner", str(req_file)], cwd=cwd,
                                        env=child_env, stdout=o, stderr=e, stdin=subprocess.DEVNULL)
            return Running(self, proc.pid, out, err, started, proc)
        assert self._zygote is not None and self._zygote.stdin is not None
        self._zygote.stdin.write(json.dumps(req) + "\n")
        self._zygote.stdin.flush()
        return Running(self, self._reply(60)["pid"], out, err, started)

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, patches: dict[str, Any] | None = None,
            timeout: float = 120) -> Result:
        return self.start(argv, env, cwd, patches).wait(timeout)

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.stdin.close()  # type: ignore[union-attr]
            self._zygote.wait(30)
        self._tmp.cleanup()


def base_env(home: Path) -> dict[str, str]:
    """A clean environment: temporary homes and caches, no tokens, no proxies, no telemetry, no progress bars."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8",
        "HF_HOME": str(home / "hf"), "MODELSCOPE_CACHE": str(home / "ms-cache"),
        "MODELSCOPE_HOME": str(home / ".modelscope"), "XDG_CACHE_HOME": str(home / ".cache"),
        "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "HF_HUB_DISABLE_XET": "1",
        "MODELSCOPE_DOWNLOAD_INTRA_CLOUD": "false", "TQDM_DISABLE": "1", "NO_COLOR": "1", "COLUMNS": "200",
        "NO_PROXY": "127.0.0.1,localhost", "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONPATH": str(REPO_ROOT),  # the checkout under test (a worktree), not the one the venv installed
    }


def client_env(tmp_path: Path, hubs: FakeHubs, **extra: str) -> dict[str, str]:
    env = base_env(tmp_path / "home")
    env.update(HF_ENDPOINT=hubs.hub_url, MODELSCOPE_ENDPOINT=hubs.ms_url)
    env.update(extra)
    return env


_RUNNER: list[CliRunner] = []


@pytest.fixture
def cli() -> CliRunner:
    """One fork server for the whole session, shared by every test module that imports this fixture
    (a session fixture imported into several modules would start one per module)."""
    if not _RUNNER:
        _RUNNER.append(CliRunner(spawn=os.environ.get("FLUX_PORT_TEST_SPAWN") == "1"))
        atexit.register(_RUNNER[0].close)
    return _RUNNER[0]


@pytest.fixture
def hubs() -> Iterator[FakeHubs]:
    servers = FakeHubs()
    yield servers
    servers.close()
