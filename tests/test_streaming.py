"""The streaming writer: file-to-file copies and in-memory tensors give the same bytes and the same identity."""

from __future__ import annotations

import json
import os

import torch

from porting.engine.convert import convert, prepare
from porting.tensors.checkpoint import hash_checkpoint, open_checkpoint
from porting.tensors.writer import Segments, _Copier

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


def test_copied_tensors_keep_their_page_offset(tmp_path, tiny2_file):
    """Output follows the source's storage order and the header is padded so that every copied tensor sits at the
    same offset modulo 4096 as in the source (the kernel copies page-aligned data much faster)."""
    convert(tiny2_file, tmp_path / "out", strict=True)
    src = open_checkpoint(tiny2_file).tensors
    out = open_checkpoint(tmp_path / "out").tensors
    renamed = {"img_in.weight": "x_embedder.weight", "single_blocks.1.linear1.weight":
               "single_transformer_blocks.1.attn.to_qkv_mlp_proj.weight",
               "final_layer.linear.weight": "proj_out.weight"}
    for s, o in renamed.items():
        assert src[s].start % 4096 == out[o].start % 4096
    # the output's tensor order is the source's storage order (so the source is read front to back)
    _, _, plan = prepare(tiny2_file)
    source_of = {t: ps.stored_sources[0] for ps in plan.steps for t in ps.step.targets}
    in_output_order = sorted(out, key=lambda k: out[k].start)
    starts = [src[source_of[k]].start for k in in_output_order]
    assert starts == sorted(starts)
