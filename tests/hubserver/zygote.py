"""A fork server for CLI runs: imports the heavy part of `port` once, then forks one child per request.

`port` imports torch, and its main() imports diffusers and transformers (to quiet their logging), which also
imports huggingface_hub: a real `port fetch` process has huggingface_hub's import-time constants set before the
fetch code runs, and so do these children (from this server's clean environment: temporary HF_HOME, no token,
no HF_ENDPOINT). flux-port passes endpoint, token and timeouts to the client explicitly, so they come from each
child's own environment. modelscope_hub is not imported here: each child configures and imports it itself.
Each child gets a fresh environment, working folder and stdout/stderr files.
Protocol on stdin/stdout, one JSON object per line:
  request  {"argv", "env", "cwd", "stdout", "stderr", "patches"}
  replies  {"pid": N}   when the child is started, then {"pid": N, "code": exit code (negative: signal)}
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _child(req: dict) -> None:
    code = 99
    try:
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(req[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        from hubserver.runner import run

        code = run(req["argv"], req.get("patches", {}))
    except BaseException:  # noqa: BLE001 - report anything to the test through stderr
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    from hubserver import runner  # noqa: F401  (imported before any child changes its working folder)

    import porting.cli.app  # noqa: F401  (torch and the CLI, imported once)
    import porting.cli.fetch_cmd  # noqa: F401  (the verb these tests run: `port` imports it as it runs)

    for name in ("diffusers", "transformers", "requests"):  # what main() and the clients import anyway
        try:
            __import__(name)
        except ImportError:
            pass

    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
