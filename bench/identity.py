"""What naming a converted transformer costs the verbs after convert (validate, publish, publish --push).

    python bench/identity.py                           # klein-4B shapes cut to 1 + 2 blocks (1.37 GB)
    python bench/identity.py --model klein-4b --full   # the whole klein-4B (7.75 GB)

Writes a synthetic source (real shapes, bf16, not measured), converts it with `port convert` (which records each
tensor's sha256 it has, sealed by inode, but neither the weights identity nor the files' own sha256: the first verb
that names the weights or certifies a file takes them and records them), then times, in child processes, what
publish does to name the transformer: its weights identity (`Source.weights_sha256`) and every shard's sha256 for
`manifest.json` (the Hub's LFS oid too):

  (a) with the records convert kept (the first run takes each file's sha256 once and records it; with --repeat 3
      or more the median is a run after it: what a second publish or a push pays);
  (b) with a fresh state folder, so nothing is known (a transformer flux-port did not write): the tensors and the
      files are hashed (before issue 33 publish always did this, and read each tensor through torch);

each from a warm and from a cold page cache, median of --repeat runs. Not part of CI; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import load_average, prepare_source  # noqa: E402  (bench/convert.py)

NAME = """
import sys, time
from pathlib import Path
from porting.inputs import open_source
from porting.known_digests import file_sha256
out = Path(sys.argv[1])
start = time.perf_counter()
weights = open_source(out).weights_sha256
files = [file_sha256(f) for f in sorted(out.glob("*.safetensors"))]
print(f"{time.perf_counter() - start:.3f} {weights}")
"""


def timed(out: Path, state: Path, warm: bool) -> tuple[float, str]:
    for f in out.glob("*.safetensors"):
        prepare_source(f, warm)
    env = {**os.environ, "FLUX_PORT_STATE_DIR": str(state)}
    done = subprocess.run([sys.executable, "-c", NAME, str(out)], env=env, check=True, capture_output=True,
                          text=True)
    seconds, weights = done.stdout.split()
    return float(seconds), weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["klein-4b", "klein-9b"], default="klein-4b")
    parser.add_argument("--full", action="store_true", help="the whole model, not 1 double + 2 single blocks")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)

    from porting.demo.tiny import REAL_FLUX2, write_random_checkpoint

    config = dict(REAL_FLUX2[args.model])
    if not args.full:
        config.update(num_layers=1, num_single_layers=2)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="flux-port-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    state, fresh = work / "state", work / "fresh-state"
    try:
        src = write_random_checkpoint(work / "source.safetensors", config, "original", "BF16", seed=0, fill="tiled")
        out = work / "transformer"
        env = {**os.environ, "FLUX_PORT_STATE_DIR": str(state)}
        subprocess.run([sys.executable, "-m", "porting", "convert", str(src), "--out", str(out), "--json", "--force"],
                       env=env, check=True, capture_output=True)
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        print(f"flux-port identity benchmark: {args.model}{'' if args.full else ' cut to 1,2 blocks'}, "
              f"{size / 1e9:.2f} GB converted, load average {load_average()}")
        for warm in (True, False):
            rows = {}
            for label, folder in (("kept by convert", state), ("nothing kept", fresh)):
                runs = []
                for _ in range(args.repeat):
                    if folder == fresh:
                        shutil.rmtree(fresh, ignore_errors=True)
                    runs.append(timed(out, folder, warm))
                rows[label] = runs
            weights = {w for runs in rows.values() for _, w in runs}
            assert len(weights) == 1, f"the identities differ: {weights}"
            for label, runs in rows.items():
                each = ", ".join(f"{s:.2f}" for s, _ in runs)
                print(f"{'warm' if warm else 'cold'} page cache, {label:<22} median "
                      f"{statistics.median(s for s, _ in runs):7.3f} s ({each})")
        print(f"load average at the end {load_average()}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
