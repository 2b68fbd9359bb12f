"""The streaming writer: file-to-file copies and in-memory tensors give the same bytes and the same identity."""

from __future__ import annotations

import json
import os

import torch

from porting.checkpoint import hash_checkpoint, open_checkpoint
from porting.convert import convert
from porting.writer import Segments, _Copier

from .helpers import assert_same_tensors, load_folder


def test_manifest_identity_matches_a_fresh_hash_of_the_output(tmp_path, tiny2_file):
    """Row moves are copied and hashed on a second thread; casts go through memory. Both record the identity
    that `hash_checkpoint` recomputes from the written files."""
    for name, dtype in (("copied", "keep"), ("cast", "fp32")):
        result = convert(tiny2_file, tmp_path / name, dtype=dtype)
        manifest = json.loads((tmp_path / name / "flux-port.json").read_text())
        assert manifest["weights_sha256"] == result.weights_sha256
        assert hash_checkpoint(open_checkpoint(tmp_path / name)) == result.weights_sha256
    # the bf16 -> fp32 conversion holds the same values as the copied bf16 one
    copied, cast = load_folder(tmp_path / "copied"), load_folder(tmp_path / "cast")
    assert_same_tensors({k: v.float() for k, v in copied.items()}, cast)


def test_copier_fallback_without_kernel_copy_gives_the_same_bytes(tmp_path):
    src = tmp_path / "src.bin"
    data = os.urandom(3 * 2**20 + 17)
    src.write_bytes(data)
    parts = ((src, 2**20, 2**20 + 5), (src, 0, 2**20), (src, 3 * 2**20, 17))
    expected = b"".join(data[o:o + n] for _, o, n in parts)
    for kernel_copy in (True, False):
        copier = _Copier()
        copier.kernel_copy = kernel_copy and copier.kernel_copy
        out = tmp_path / f"out-{kernel_copy}.bin"
        with open(out, "wb", buffering=0) as f:
            f.write(b"HEAD")
            copier.copy(Segments(parts, "x"), f.fileno())
        copier.close()
        assert out.read_bytes() == b"HEAD" + expected


def test_read_returns_exact_tensors_and_row_ranges(tmp_path, tiny2_file):
    ckpt = open_checkpoint(tiny2_file)
    from safetensors.torch import load_file

    ref = load_file(str(tiny2_file))
    for key, tensor in ref.items():
        assert torch.equal(ckpt.read(key), tensor)
    key = "double_blocks.0.img_attn.qkv.weight"
    assert torch.equal(ckpt.read(key, rows=(64, 128)), ref[key][64:128])
