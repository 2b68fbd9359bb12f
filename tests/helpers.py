"""Shared test helpers: tiny reference models as checkpoints, raw safetensors writing, CLI runs, leftovers."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file

from porting.cli.app import main
from porting.skeleton import empty_weights

from .reference.flux1_bfl import Flux1Params, Flux1Reference
from .reference.flux2_bfl import Flux2Params, Flux2Reference

# Tiny geometries. FLUX.2: D 64, 2 heads of 32, RoPE (8, 8, 8, 8). FLUX.1 needs head dim 128 for (16, 56, 56).
TINY2 = Flux2Params(in_channels=16, context_dim=48, hidden=64, heads=2, depth=2, depth_single=2, axes=(8, 8, 8, 8))
TINY2_GUIDANCE = Flux2Params(**{**TINY2.__dict__, "guidance": True})
TINY1_DEV = Flux1Params(in_channels=16, vec_in_dim=24, context_dim=32, hidden=128, heads=1, depth=2,
                        depth_single=2, guidance=True)
TINY1_SCHNELL = Flux1Params(**{**TINY1_DEV.__dict__, "guidance": False})

# Real geometries (flux2-checkpoints.md section 2.2 and section 7), used on the meta device / header-only.
REAL2 = {
    "klein-4B": Flux2Params(context_dim=7680, hidden=3072, heads=24, depth=5, depth_single=20),
    "klein-9B": Flux2Params(context_dim=12288, hidden=4096, heads=32, depth=8, depth_single=24),
    "FLUX.2-dev": Flux2Params(context_dim=15360, hidden=6144, heads=48, depth=8, depth_single=48, guidance=True),
}
REAL1 = {"FLUX.1-dev": Flux1Params(), "FLUX.1-schnell": Flux1Params(guidance=False)}


def reference_model(params: Flux1Params | Flux2Params, seed: int = 0) -> torch.nn.Module:
    """A reference model with random weights at a scale that keeps activations O(1) through the blocks."""
    model = Flux2Reference(params) if isinstance(params, Flux2Params) else Flux1Reference(params)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(".scale"):  # RMSNorm scales around 1
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:  # biases
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))
    return model.eval()


def save_state(path: Path, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None,
               prefix: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: (v.to(dtype) if dtype else v).contiguous() for k, v in state.items()}, str(path))
    return path


def meta_shapes(params: Flux1Params | Flux2Params) -> dict[str, tuple[int, ...]]:
    with empty_weights():
        model = Flux2Reference(params) if isinstance(params, Flux2Params) else Flux1Reference(params)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def write_header_only(path: Path, shapes: Mapping[str, tuple[int, ...]], dtype: str = "BF16") -> Path:
    """A safetensors file with a real header and a sparse hole for the data: full logical size, ~no disk.

    Written by hand (not with the engine's writer) so the header is an independent witness.
    """
    itemsize = {"BF16": 2, "F16": 2, "F32": 4}[dtype]
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for key, shape in shapes.items():
        n = math.prod(shape) * itemsize
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return path


def write_raw_safetensors(path: Path, header: dict, data: bytes) -> Path:
    """Any header (even a lying one) followed by `data`."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a converted folder (single file or shards)."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        part = load_file(str(f))
        assert not set(part) & set(out), f"tensor stored twice in {folder}"
        out.update(part)
    return out


def assert_same_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    """Same key set; every tensor with the same dtype, shape and bytes (bitwise, so NaN patterns count too)."""
    assert set(a) == set(b), f"only left: {sorted(set(a) - set(b))[:5]}, only right: {sorted(set(b) - set(a))[:5]}"
    for k in a:
        x, y = a[k], b[k]
        assert (x.dtype, x.shape) == (y.dtype, y.shape), f"{k}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}"
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), f"{k}: bytes differ"


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def msg(self) -> str:
        """stderr with whitespace runs (terminal wrapping, table padding) collapsed to single spaces."""
        return " ".join(self.err.split())


def run_port(capsys, *argv: str | Path) -> Run:
    """`port ARGV...` in this process (main() always ends in SystemExit); returns exit code, stdout, stderr."""
    capsys.readouterr()
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    captured = capsys.readouterr()
    return Run(code, captured.out, captured.err)


def run_cli(argv: list, capsys) -> tuple[int, str, str]:
    """`port ARGV...` in this process as (exit code, stdout, stderr)."""
    run = run_port(capsys, *argv)
    return run.code, run.out, run.err


def leftovers(out: Path) -> list[str]:
    """The output folder and any staging / backup folder convert may have created next to it."""
    parent = Path(out).parent
    if not parent.exists():
        return []
    name = Path(out).name
    return sorted(p.name for p in parent.iterdir()
                  if p.name == name or p.name.startswith(f".{name}.partial-") or p.name.startswith(f".{name}.old-"))


def compare_outputs(reference: torch.Tensor, candidate: torch.Tensor) -> str:
    """Where two outputs differ most: max |diff|, the worst (batch, token), share of elements above 1e-5."""
    diff = (reference - candidate).abs()
    worst = torch.nonzero(diff == diff.max())[0].tolist()
    share = (diff > 1e-5).float().mean().item()
    return (f"max |diff| {diff.max().item():.3g} at batch {worst[0]} token {worst[1]}, "
            f"{share:.1%} of elements above 1e-5, output max |x| {reference.abs().max().item():.3g}")


def mount_tmpfs(mount: Path, size: str):
    """A real filesystem of `size` (tmpfs) at `mount` for one test (a generator for fixtures); needs root, which CI
    and this machine have; skipped, with the reason, where it cannot be mounted."""
    import subprocess

    import pytest

    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
