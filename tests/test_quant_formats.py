"""Every quantized input format, end to end, against independent producers and an independent forward.

For each layout a tiny FLUX.2 file is written by the format's own producer (comfy-kitchen for ComfyUI layouts,
diffusers' BFL-scheme quantizer, the gguf package's quantizer), converted with `port convert --strict --dtype fp32`,
loaded strictly into diffusers' Flux2Transformer2DModel, and run against the repository's BFL reference forward
holding the weights as the producer itself dequantizes them (float32): relative L2 below 1e-5. The same output is
also compared with the unquantized model: the quantization error must be visible there, so a reader that ignored
the scales, or read the original weights by some other way, could not pass.
"""

from __future__ import annotations

import json

import pytest
import torch

from . import quantfiles as qf
from .helpers import TINY2, reference_model, run_port
from .reference.flux2_bfl import Flux2Reference
from .test_equivalence import flux2_inputs, load_strict, run_flux2_pair

TOL = 1e-5


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def state():
    return reference_model(TINY2, seed=5).state_dict()


def _build(kind: str, state, folder):
    """(file, oracle state, what the manifest must say it was dequantized from)"""
    if kind == "comfy-scaled-fp8":
        tensors, oracle = qf.comfy_scaled_fp8(state)
        return qf.save(folder / "scaled.safetensors", tensors), oracle, "ComfyUI scaled fp8"
    if kind.startswith("comfy-"):
        fmt, _, declare = kind[len("comfy-"):].partition("@")
        tensors, oracle, meta = qf.comfy_mixed(state, fmt, declare=declare or "tensor",
                                               pre_quant_scale=fmt in ("nvfp4", "float8_e4m3fn"))
        return qf.save(folder / "mixed.safetensors", tensors, meta), oracle, "ComfyUI mixed precision"
    if kind == "bfl-fp8":
        tensors, oracle = qf.bfl_fp8(state)
        return qf.save(folder / "bfl-fp8.safetensors", tensors), oracle, "BFL fp8"
    if kind == "diffusers-fp8r-nvfp4":
        tensors, oracle = qf.diffusers_bfl(state)
        return qf.save(folder / "fp8r-nvfp4.safetensors", tensors), oracle, "diffusers BFL scheme"
    if kind == "modelopt-int8":
        tensors, oracle = qf.modelopt_int8(state)
        return qf.save(folder / "int8.safetensors", tensors), oracle, "ModelOpt int8"
    if kind.startswith("gguf-"):
        path = folder / "model.gguf"
        return path, qf.gguf_file(path, state, kind[len("gguf-"):]), "GGUF"
    raise AssertionError(kind)


KINDS = ["comfy-scaled-fp8", "comfy-float8_e4m3fn", "comfy-float8_e5m2", "comfy-nvfp4", "comfy-nvfp4@metadata",
         "comfy-mxfp8", "comfy-int8_tensorwise", "bfl-fp8", "diffusers-fp8r-nvfp4", "modelopt-int8",
         "gguf-Q8_0", "gguf-Q4_0", "gguf-Q5_1"]


@pytest.mark.parametrize("kind", KINDS)
def test_converted_quantized_file_computes_the_reference_with_producer_dequantized_weights(tmp_path, capsys, state,
                                                                                          kind):
    src, oracle, label = _build(kind, state, tmp_path)
    out = tmp_path / "transformer"
    run = run_port(capsys, "convert", src, "--out", out, "--strict", "--dtype", "fp32", "--quiet", "--json")
    assert run.code == 0, run.err
    doc = json.loads(run.out)
    assert doc["dequantized_from"].startswith(label) and doc["quantization"]["dequantized_tensors"] == 20
    manifest = json.loads((out / "flux-port.json").read_text())
    assert manifest["dequantized_from"] == doc["dequantized_from"] and manifest["dtype"] == "fp32"

    model = load_strict(_cls(), out)
    expected = Flux2Reference(TINY2)
    expected.load_state_dict(oracle, strict=True)
    unquantized = reference_model(TINY2, seed=5)
    inp = flux2_inputs(TINY2)
    ref, got = run_flux2_pair(expected.eval(), model, inp)
    plain, _ = run_flux2_pair(unquantized, model, inp)
    assert rel_l2(got, ref) < TOL, f"{kind}: rel L2 {rel_l2(got, ref):.3g} against the producer's dequantization"
    assert rel_l2(got, plain) > 100 * TOL, f"{kind}: quantization left no trace; the test could not fail"


def _cls():
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel


@pytest.mark.parametrize("kind", ["comfy-nvfp4", "comfy-scaled-fp8", "modelopt-int8", "gguf-Q8_0"])
def test_quantized_source_defaults_to_bf16_rounded_once_from_the_float32_dequantization(tmp_path, state, kind):
    """`--dtype keep` on a quantized file writes bf16: the producer's float32 dequantization rounded once, bit for
    bit (per-tensor scales take a table-lookup path that must give exactly these bits)."""
    from safetensors.torch import load_file

    from porting.engine.convert import convert

    src, oracle, label = _build(kind, state, tmp_path)
    result = convert(src, tmp_path / "out", strict=True)
    written = load_file(str(tmp_path / "out" / "diffusion_pytorch_model.safetensors"))
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    for target, source in (("transformer_blocks.0.attn.to_q.weight", "double_blocks.0.img_attn.qkv.weight"),
                           ("single_transformer_blocks.1.attn.to_out.weight", "single_blocks.1.linear2.weight")):
        want = oracle[source][:64] if target.endswith("to_q.weight") else oracle[source]
        assert torch.equal(written[target].view(torch.int16), want.to(torch.bfloat16).view(torch.int16)), target
    assert result.quantization and result.quantization["label"].startswith(label)


def test_code_tables_give_the_bits_of_the_float32_product():
    """Every code of every one-byte storage dtype (NaN codes included), each output dtype, odd sizes too."""
    from porting.tensors.quant import kernels

    for storage in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8):
        codes = torch.arange(256, dtype=torch.uint8).repeat(3)[:-1].reshape(1, -1).view(storage)
        for scale in (torch.tensor(0.0123), torch.tensor(3.5e-5)):
            for out in (torch.bfloat16, torch.float16, torch.float32):
                got = kernels.lookup(codes, kernels.code_table(storage, scale, out))
                want = (codes.float() * scale).to(out)
                bits = {2: torch.int16, 4: torch.int32}[out.itemsize]
                assert torch.equal(got.view(bits), want.view(bits)), (storage, out)


@pytest.mark.parametrize("kind", ["comfy-nvfp4", "comfy-mxfp8", "diffusers-fp8r-nvfp4", "gguf-Q4_0"])
def test_small_row_blocks_write_the_same_bytes(tmp_path, state, monkeypatch, kind):
    """Dequantization in row blocks (what keeps memory flat on real sizes) gives the bytes of a whole-tensor pass:
    block boundaries cut through swizzled scale tiles, packed rows and GGUF rows."""
    from porting.engine import convert as convert_mod

    src, _, _ = _build(kind, state, tmp_path)
    convert_mod.convert(src, tmp_path / "whole", strict=True)
    monkeypatch.setattr(convert_mod, "BLOCK_ELEMENTS", 7 * 64)  # 7 rows of a 64-column weight per block
    convert_mod.convert(src, tmp_path / "blocks", strict=True)
    a = (tmp_path / "whole" / "diffusion_pytorch_model.safetensors").read_bytes()
    b = (tmp_path / "blocks" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert a == b


def test_dequantizing_limits_torch_threads_on_its_own_thread_only(tmp_path, state, monkeypatch):
    """The writer's producing thread leaves the writer and hasher their cores (torch's spinning OpenMP workers
    took a third of a GGUF convert's time on two cores); the caller's own torch thread count is untouched."""
    import os

    from porting.engine import convert as convert_mod

    seen = []
    real = convert_mod._row_blocks

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        yield from real(*args, **kwargs)

    monkeypatch.setattr(convert_mod, "_row_blocks", spy)
    before = torch.get_num_threads()
    src, _, _ = _build("gguf-Q8_0", state, tmp_path)
    convert_mod.convert(src, tmp_path / "out", strict=True)
    assert seen and set(seen) == {max(1, len(os.sched_getaffinity(0)) - 2)}
    assert torch.get_num_threads() == before


def test_gguf_k_quants_read_as_the_gguf_package_dequantizes_them(tmp_path, state):
    """K-quants have no quantizer in the gguf package: blocks with valid scales and random codes, written by its
    writer; flux-port's rows must equal the package's own dequantization, shapes reversed back."""
    import gguf
    import numpy as np

    from porting.tensors.checkpoint import open_checkpoint

    rng = np.random.default_rng(0)
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "flux")
    expected = {}
    for i, name in enumerate(("Q4_K", "Q6_K", "Q3_K")):
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = 8 + i, 2 * block
        raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
        half = np.array([0.01], dtype=np.float16).view(np.uint8)  # fp16 super-block scales: Q4_K first, else last
        at = [size - 2] if name == "Q6_K" else [0, 2] if name == "Q4_K" else [size - 2]
        for a in at:
            raw[..., a], raw[..., a + 1] = half[0], half[1]
        data = raw.reshape(rows, -1)
        writer.add_tensor(f"t{i}", data, raw_shape=data.shape, raw_dtype=qtype)
        expected[f"t{i}"] = torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ckpt = open_checkpoint(path)
    assert ckpt.quantization.layers == {"Q4_K": 1, "Q6_K": 1, "Q3_K": 1}
    for key, want in expected.items():
        assert tuple(ckpt.tensors[key].shape) == tuple(want.shape)
        assert torch.equal(ckpt.read(key), want) and torch.isfinite(want).all()
        assert torch.equal(torch.cat([ckpt.read(key, (0, 3)), ckpt.read(key, (3, want.shape[0]))]), want)


def test_prefetched_blocks_keep_order_pass_errors_and_stop_with_the_consumer():
    import threading

    from porting.tensors.prefetch import prefetched

    assert list(prefetched(iter(range(50)), depth=2)) == list(range(50))

    def failing():
        yield 1
        raise ValueError("bad block")

    got = []
    with pytest.raises(ValueError, match="bad block"):
        for x in prefetched(failing()):
            got.append(x)
    assert got == [1]
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    gen = prefetched(endless(), depth=2)
    assert next(gen) == 0
    gen.close()  # the consumer stops early: the producer thread must end, not block on a full queue
    assert not any(t.name == "flux-port-prefetch" for t in threading.enumerate())
    assert len(produced) <= 5


def test_q8_0_fast_path_is_bit_identical_to_the_gguf_package(monkeypatch):
    import gguf
    import numpy as np

    from porting.tensors import gguf_reader
    from porting.tensors.gguf_reader import q8_0

    monkeypatch.setattr(gguf_reader, "Q8_0_PIECE", 7)  # 99 blocks: many pieces and a short last one

    rng = np.random.default_rng(1)
    data = (rng.standard_normal((33, 96)) * rng.choice([1e-4, 1.0, 300.0], size=(33, 1))).astype(np.float32)
    q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
    want = torch.from_numpy(np.array(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0), dtype=np.float32))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = q8_0(q.copy(), dtype)
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))
