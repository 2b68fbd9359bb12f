"""Writing Nunchaku SVDQuant files (`port convert --quantize svdq-*`): deepcompressor's packers are the oracle.

Every packed tensor of a written file is unpacked (the reader's unpackers, themselves held to deepcompressor in
test_svdquant_read.py) and packed again by deepcompressor's `NunchakuWeightPacker` / TinyChat's `pack_w4`: the
bytes must be the file's. Reading the file back through the reader must give the weights the writer meant, computed
here from the quantizer's logical output (codes, scales, s, U, D) with this file's own decode tables.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from porting.cli.app import main

from .helpers import leftovers, reference_model, run_port, save_state
from .reference.flux1_bfl import Flux1Params
from .reference.flux2_bfl import Flux2Params

pytest.importorskip("deepcompressor.backend.nunchaku.utils",
                    reason="the oracle: pip install --no-deps deepcompressor-toolkit==0.1.0 (as .ci/run does)")

# the narrowest geometries SVDQuant's 128-wide tiles allow, Gaussian weights (reference_model: randn / sqrt(in))
TINY1 = Flux1Params(in_channels=16, vec_in_dim=24, context_dim=32, hidden=128, heads=1, depth=1, depth_single=1)
TINY2 = Flux2Params(in_channels=16, context_dim=48, hidden=128, heads=2, depth=1, depth_single=1,
                    axes=(16, 16, 16, 16))
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
CASES = [("flux1", "int4"), ("flux1", "nvfp4"), ("flux2", "int4"), ("flux2", "nvfp4")]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("svdq-src")
    return {"flux1": save_state(root / "flux1-tiny.safetensors", reference_model(TINY1, seed=3).state_dict(),
                                torch.bfloat16),
            "flux2": save_state(root / "klein-tiny.safetensors", reference_model(TINY2, seed=4).state_dict(),
                                torch.bfloat16)}


@pytest.fixture(scope="module")
def written(sources, tmp_path_factory) -> dict[tuple[str, str], dict]:
    """Each tiny model converted once per precision, through the CLI; (family, precision) -> the --json document."""
    root = tmp_path_factory.mktemp("svdq-out")
    out = {}
    for family, precision in CASES:
        folder = root / f"{family}-{precision}"
        argv = ["convert", str(sources[family]), "--quantize", f"svdq-{precision}", "--out", str(folder), "--json"]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):  # a module-scoped fixture has no capsys
            try:
                main(argv)
            except SystemExit as e:
                assert not e.code, buf.getvalue()
        doc = json.loads(buf.getvalue())
        doc["path"] = folder / doc["file"]
        out[family, precision] = doc
    return out


def _tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("family,precision", CASES)
def test_packed_bytes_are_deepcompressors(written, family, precision):
    from deepcompressor.backend.nunchaku.utils import NunchakuWeightPacker
    from deepcompressor.backend.tinychat.utils import pack_w4

    from porting.tensors.quant.svdq import tiles as P
    from porting.tensors.quant.svdq import tiles as W

    tensors, _ = _tensors(written[family, precision]["path"])
    packer = NunchakuWeightPacker(bits=4)
    checked = {"qweight": 0, "wscales": 0, "vector": 0, "lowrank": 0, "awq": 0}
    prefixes = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")}
    for p in sorted(prefixes):
        q = tensors[p + ".qweight"]
        if q.dtype == torch.int32:  # AWQ W4A16 (FLUX.1 adaLN)
            n, k = q.shape[0] * 4, q.shape[1] * 2
            codes = P.unpack_awq_codes(q, n, k).to(torch.int32)
            assert torch.equal(pack_w4(codes.clone()).view(torch.int32), q), p
            checked["awq"] += 1
            continue
        n, k = q.shape[0], q.shape[1] * 2
        codes = P.unpack_codes(q, n, k).to(torch.int32)
        assert torch.equal(packer.pack_weight(codes.clone()), q), p
        checked["qweight"] += 1
        ws = tensors[p + ".wscales"]
        if precision == "int4":
            logical = P.unpack_scales(ws, n, k // 64)
            assert torch.equal(packer.pack_scale(logical.reshape(n, 1, k // 64, 1).clone(), 64), ws), p
        else:
            logical = P.unpack_micro_scales(ws, n, k)
            again = packer.pack_scale(logical.to(torch.bfloat16).reshape(n, 1, k // 16, 1).clone(), 16)
            assert torch.equal(again.view(torch.uint8), ws.view(torch.uint8)), p
        checked["wscales"] += 1
        for part in ("bias", "smooth", "smooth_orig", "smooth_factor", "smooth_factor_orig", "wcscales"):
            if p + "." + part in tensors:
                v = tensors[p + "." + part]
                again = packer.pack_scale(P.unpack_vector(v).reshape(-1, 1, 1, 1).clone(), v.numel())
                assert torch.equal(again.reshape(-1), v), p + part
                checked["vector"] += 1
        for down_name, up_name in (("lora_down", "lora_up"), ("proj_down", "proj_up")):
            if p + "." + down_name in tensors:
                d, u = tensors[p + "." + down_name], tensors[p + "." + up_name]
                assert torch.equal(packer.pack_lowrank_weight(P.unpack_lowrank(d, True).clone(), down=True), d)
                assert torch.equal(packer.pack_lowrank_weight(P.unpack_lowrank(u, False).clone(), down=False), u)
                assert torch.equal(W.pack_lowrank(P.unpack_lowrank(d, True), True), d)
                checked["lowrank"] += 1
    assert checked["qweight"] and checked["wscales"] and checked["vector"] and checked["lowrank"]
    assert (checked["awq"] > 0) == (family == "flux1")


@pytest.mark.parametrize("family,precision", CASES)
def test_header_is_nunchakus(written, family, precision):
    doc = written[family, precision]
    path = doc["path"]
    tag = "int4" if precision == "int4" else "fp4"
    assert path.name == f"svdq-{tag}_r32-{'flux1-tiny' if family == 'flux1' else 'klein-tiny'}.safetensors"
    tensors, meta = _tensors(path)
    q = json.loads(meta["quantization_config"])
    assert q["method"] == "svdquant" and q["rank"] == 32
    assert q["weight"]["dtype"] == ("int4" if precision == "int4" else "fp4_e2m1_all")
    assert q["weight"]["group_size"] == (64 if precision == "int4" else 16)
    assert meta["model_class"] == ("NunchakuFluxTransformer2dModel" if family == "flux1"
                                   else "NunchakuFlux2Transformer2DModel")
    config = json.loads(meta["config"])
    assert config["_class_name"] == ("FluxTransformer2DModel" if family == "flux1" else "Flux2Transformer2DModel")
    if family == "flux1":  # deepcompressor's names, biases, AWQ adaLN
        assert "transformer_blocks.0.qkv_proj.lora_down" in tensors and "transformer_blocks.0.norm_q.weight" in tensors
        assert tensors["transformer_blocks.0.norm1.linear.qweight"].dtype == torch.int32
        assert "single_transformer_blocks.0.mlp_fc2.bias" in tensors
    else:  # module names, no bias (tonera's strict loader), norms under their diffusers names
        assert "transformer_blocks.0.attn.to_qkv.proj_down" in tensors
        assert "single_transformer_blocks.0.attn.mlp_fc1.smooth_factor" in tensors
        assert "transformer_blocks.0.attn.norm_q.weight" in tensors
        assert not [k for k in tensors if k.endswith(".bias")]
    if precision == "nvfp4":
        fused = "transformer_blocks.0.qkv_proj" if family == "flux1" else "transformer_blocks.0.attn.to_qkv"
        assert f"{fused}.wcscales" in tensors and f"{fused}.wtscale" not in tensors
    assert doc["svdq"]["file_bytes"] == path.stat().st_size < doc["svdq"]["bf16_bytes"]
    assert json.loads(meta["flux_port"])["smoothing"].startswith("data-free")


@pytest.mark.parametrize("family,precision", CASES)
def test_branch_lowers_the_error_of_plain_rounding(written, family, precision):
    quality = written[family, precision]["svdq"]["quality"]
    w4a4 = {k: v for k, v in quality.items() if v["layer"].startswith("W4A4")}
    assert len(w4a4) >= (8 if family == "flux2" else 15)
    for kind, row in w4a4.items():
        assert row["rel_error"] < row["plain_rel_error"], (kind, row)
    for row in quality.values():
        assert 0 < row["rel_error"] < 0.2


def _meant(source: Path, family: str, precision: str) -> dict[str, torch.Tensor]:
    """The weights the writer means, from the quantizer's logical output decoded here (not by the reader)."""
    from porting.engine.convert import plan_source, weights_source
    from porting.engine.svdq_convert import PlanTensors
    from porting.tensors.export.svdquant import _bias, _Shared, _weight, shared_amax, shared_smoothing
    from porting.tensors.quant.svdq import layout as L
    from porting.tensors.quant.svdq.quantize import quantize_awq, quantize_w4a4

    src = weights_source(source)
    ckpt, detection, plan = plan_source(src, "diffusers")
    shapes = {k: s for k, s, _ in plan.outputs()}
    layout = L.plan_file(family, detection.config, shapes, "test")
    tensors = PlanTensors(ckpt, plan)
    out: dict[str, torch.Tensor] = {}
    # the factors the writer shares between the layers made of one diffusers linear (its rows: one smoothing; its
    # columns: one nvfp4 per-tensor scale), so that they join back into that linear exactly
    shared = _Shared({})
    for layer in layout.layers:
        if len(layer.weight) == 1 and layer.weight[0].cols is not None:
            shared.siblings.setdefault(layer.weight[0].key, []).append(layer)
    for layer in layout.layers:
        smooth = shared_smoothing(layer, tensors, None, shared.smooths)
        amax = (shared_amax(layer, shared.siblings.get(layer.weight[0].key, []), tensors, 32, None, shared.amax,
                            "test") if precision == "nvfp4" else None)
        w = _weight(layer, tensors, "test")
        if layer.kind == "awq":
            q = quantize_awq(w)
            g = q.codes.float().view(layer.n, -1, 64) * q.scales.float()[..., None] + q.zeros.float()[..., None]
            eff = g.view(layer.n, layer.k)
        else:
            q = quantize_w4a4(w, precision, 32, list(layer.pieces), smooth=smooth, amax=amax)
            if precision == "int4":
                c = q.codes.to(torch.int16)
                vals = torch.where(c >= 8, c - 16, c).float().view(layer.n, -1, 64) * q.scales.float()[..., None]
            else:
                rows = torch.cat([q.tensor_scales[i:i + 1].float().expand(m) for i, m in enumerate(layer.pieces)])
                vals = E2M1[q.codes.long()].view(layer.n, -1, 16) * q.scales.float()[..., None] * rows[:, None, None]
            eff = vals.view(layer.n, layer.k) / q.smooth.float() + q.up.float() @ q.down.float()
        row = 0
        for s in layer.weight:
            full = tensors.get(s.key)
            m = s.rows[1] - s.rows[0] if s.rows else (layer.n if s.cols else full.shape[0])
            piece = eff[row:row + m]
            if s.rows is None and s.cols is None:
                out[s.key] = piece
            else:
                t = out.setdefault(s.key, torch.full(full.shape, float("nan")))
                t[(slice(*s.rows) if s.rows else slice(None), slice(*s.cols) if s.cols else slice(None))] = piece
            row += m
        if layer.bias and not layer.gelu_shift and layer.kind == "w4a4":
            b = _bias(layer, tensors).to(torch.bfloat16).float()
            row = 0
            for s in layer.bias:
                m = s if isinstance(s, int) else (s.rows[1] - s.rows[0] if s.rows else None)
                if not isinstance(s, int):
                    key = s.key
                    m = m or (layer.n if len(layer.pieces) == 1 else tensors.get(key).shape[0])
                    out[key] = b[row:row + m]
                row += m
    return out


@pytest.mark.parametrize("family,precision", [("flux1", "int4"), ("flux2", "nvfp4")])
def test_read_back_is_what_the_writer_meant(written, sources, family, precision):
    from porting.inputs import open_source

    meant = _meant(sources[family], family, precision)
    view = open_source(written[family, precision]["path"], kind="weights").detection.ckpt
    assert meant
    for key, want in meant.items():
        assert not torch.isnan(want).any(), key
        got = view.read(key).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


def test_refusals(tmp_path, capsys, sources, tiny2_file):
    # hidden 64: the packed tiles need multiples of 128; refused by tensor, nothing written
    r = run_port(capsys, "convert", tiny2_file, "--quantize", "svdq-int4", "--out", tmp_path / "narrow")
    assert r.code != 0 and "multiples of 128" in r.err and "double_blocks" not in r.err
    assert leftovers(tmp_path / "narrow") == []
    r = run_port(capsys, "convert", sources["flux2"], "--quantize", "svdq-int4", "--rank", "0", "--out",
                 tmp_path / "r0")
    assert r.code == 2 and "--rank 0" in r.err and not (tmp_path / "r0").exists()
    r = run_port(capsys, "convert", sources["flux2"], "--rank", "16", "--out", tmp_path / "nq")
    assert r.code == 2 and "--rank applies to --quantize svdq" in r.err
    r = run_port(capsys, "convert", sources["flux2"], "--quantize", "svdq-int4", "--to", "original", "--out",
                 tmp_path / "to")
    assert r.code == 2 and "--to does not apply" in r.err


def test_non_finite_weight_is_refused_and_nothing_written(tmp_path, capsys):
    state = reference_model(TINY2, seed=5).state_dict()
    state["double_blocks.0.img_mlp.0.weight"][3, 5] = float("nan")
    src = save_state(tmp_path / "bad.safetensors", state, torch.bfloat16)
    r = run_port(capsys, "convert", src, "--quantize", "svdq-int4", "--out", tmp_path / "out")
    assert r.code != 0 and "NaN" in r.err and "ff.linear_in" in r.err
    assert leftovers(tmp_path / "out") == []


def test_inspect_shows_how_it_was_written(written, capsys):
    r = run_port(capsys, "inspect", written["flux2", "int4"]["path"], "--json")
    details = json.loads(r.out)["quantization"]["details"]
    assert details["precision"] == "int4" and details["rank"] == 32
    assert details["written_by"]["tool"] == "flux-port" and "SmoothQuant" in details["written_by"]["smoothing"]
    r = run_port(capsys, "inspect", written["flux2", "int4"]["path"])
    assert "written by" in r.out and "data-free" in r.out


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_the_summary_says_what_each_count_counts(tmp_path, capsys, monkeypatch, sources, family):
    """`quantized to` counts the layers stored in the file, `reread` the diffusers tensors they read back as (12 and
    14 for the tiny klein: q/k/v are one stored layer, the single block's projections two); each row names its
    unit. The error per layer kind is one summary line (the table with --verbose); on 80 columns the table goes
    vertical with no empty cell; the file size is the plan's output size."""
    monkeypatch.setenv("COLUMNS", "80")
    doc = json.loads(run_port(capsys, "convert", sources[family], "--quantize", "svdq-int4", "--out",
                              tmp_path / "j", "--json").out)
    layers, tensors = sum(doc["stored_kinds"].values()), sum(doc["reread"]["tensors"].values())
    assert layers != tensors and (family != "flux2" or (layers, tensors) == (12, 14))
    r = run_port(capsys, "convert", sources[family], "--quantize", "svdq-int4", "--out", tmp_path / "h")
    assert r.code == 0, r.err
    text = " ".join(r.out.split())
    assert f"rank 32: {layers} layers in the file (" in text
    assert f"reread the {layers} layers read back as {tensors} diffusers tensors (" in text
    assert "fuses q/k/v" in text and ("each bias is a tensor" in text) == (family == "flux1")
    share = doc["svdq"]["file_bytes"] / doc["svdq"]["bf16_bytes"]
    assert f"output size {doc['svdq']['file_bytes'] / 1e9:.3f} GB, {share:.1%} of" in text
    summary = text[text.index("SVDQuant int4 rank 32 weight error (relative L2): "):]
    kinds = len(doc["svdq"]["quality"])
    assert f"over {kinds} layer kinds" in summary and "--verbose prints each kind" in summary  # not one per kind
    assert len(r.out.splitlines()) < 30, r.out
    r = run_port(capsys, "convert", sources[family], "--quantize", "svdq-int4", "--out", tmp_path / "v", "--verbose")
    assert r.code == 0, r.err
    errors = r.out[r.out.index("SVDQuant int4 rank 32: weight error"):].splitlines()[1:]
    assert errors and all(len(line.split()) >= 2 for line in errors if line.strip()), errors  # no empty cell
    assert not any(line.startswith("weights") and "file size" in line for line in errors)


def test_rank_is_padded_to_16(tmp_path, capsys, sources):
    r = run_port(capsys, "convert", sources["flux2"], "--quantize", "svdq-int4", "--rank", "20", "--out",
                 tmp_path / "r20", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    tensors, meta = _tensors(tmp_path / "r20" / doc["file"])
    # the stored rank: nunchaku's loaders size proj_down / proj_up from it (test_svdquant_loaders.py)
    assert json.loads(meta["quantization_config"])["rank"] == 32
    assert json.loads(meta["flux_port"])["rank_asked"] == 20
    down = tensors["transformer_blocks.0.attn.to_qkv.proj_down"]
    assert down.shape[1] == 32
    from porting.tensors.quant.svdq.tiles import unpack_lowrank

    assert not unpack_lowrank(down, True)[20:].any()
    assert math.isfinite(doc["reread"]["worst_rel_l2"])
    # the name gives the stored rank, as nunchaku's names do (and as merge renames a file whose rank grew)
    assert doc["file"].startswith("svdq-int4_r32-") and (tmp_path / "r20" / doc["file"]).is_file()
    dry = json.loads(run_port(capsys, "convert", sources["flux2"], "--quantize", "svdq-int4", "--rank", "7",
                              "--dry-run", "--json").out)
    assert dry["planned_files"][0].startswith("svdq-int4_r16-")


@pytest.mark.parametrize("precision", ["int4", "nvfp4"])
def test_structure_the_branch_takes_out(precision):
    """The data-free rule on the shapes trained weights have (a low-rank part over noise; spread column ranges)
    lowers the error well below plain rounding; on i.i.d. uniform values, where there is nothing to take out, the
    layer falls back to plain rounding (s = 1, zero branch) instead of coming out worse."""
    from porting.tensors.quant.svdq.quantize import quantize_w4a4

    gen = torch.Generator().manual_seed(0)
    n, k = 256, 384
    noise = torch.randn(n, k, generator=gen) / k ** 0.5
    shapes = {"low rank + noise": noise + 3 * (torch.randn(n, 8, generator=gen) @ torch.randn(8, k, generator=gen)) / k,
              "spread columns": noise * torch.exp(0.7 * torch.randn(k, generator=gen)),
              "uniform": (torch.rand(n, k, generator=gen) * 2 - 1) / k ** 0.5}
    for name, w in shapes.items():
        q = quantize_w4a4(w.clone(), precision, 32, [n])
        ratio = math.sqrt(float(q.errors.quantized.sum() / q.errors.plain.sum()))
        if name == "uniform" and precision == "int4":
            assert ratio == pytest.approx(1.0, abs=1e-6) and not q.up.any() and torch.all(q.smooth == 1), name
        else:
            assert ratio < (0.9 if name == "uniform" else 0.8), (name, ratio)


@pytest.mark.slow  # builds the demo pipeline and runs it on 4 prompts x 4 steps, twice (6 s idle, 60 s loaded)
def test_calibrated_smoothing_uses_the_input_maxima(tmp_path, capsys, sources):
    """--calibrate runs the bf16 model in the tiny demo pipeline (its text encoder and VAE) and sets each layer's
    smoothing from the recorded input maxima: the file's factors are the rule applied to them."""
    from porting.demo.tinypipe import build_demo_base
    from porting.pipeline.calibrate import input_maxima
    from porting.tensors.quant.svdq.quantize import smoothing
    from porting.tensors.quant.svdq.tiles import unpack_vector

    base = build_demo_base(tmp_path / "base")
    r = run_port(capsys, "convert", sources["flux2"], "--out", tmp_path / "bf16")
    assert r.code == 0, r.err
    r = run_port(capsys, "convert", tmp_path / "bf16", "--quantize", "svdq-int4", "--calibrate", base, "--out",
                 tmp_path / "cal", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["svdq"]["smoothing"].startswith("calibrated")
    tensors, meta = _tensors(tmp_path / "cal" / doc["file"])
    assert json.loads(meta["flux_port"])["smoothing"].startswith("calibrated")
    maxima = input_maxima(base, tmp_path / "bf16")
    from safetensors.torch import load_file

    state = {k: v.float() for k, v in load_file(str(next((tmp_path / "bf16").glob("*.safetensors")))).items()}
    for stored, module, cols in (("transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.to_out.0", None),
                                 ("single_transformer_blocks.0.attn.mlp_fc2", "single_transformer_blocks.0.attn.to_out",
                                  (128, 512))):
        w = state[module + ".weight"]
        x = maxima[module]
        if cols:
            w, x = w[:, cols[0]:cols[1]], x[cols[0]:cols[1]]
        got = unpack_vector(tensors[stored + ".smooth_factor"])
        assert torch.equal(got, smoothing(w, x)), stored
        assert not torch.equal(got, smoothing(w)), stored  # not the data-free factors
    r = run_port(capsys, "convert", tmp_path / "bf16", "--calibrate", base, "--out", tmp_path / "x")
    assert r.code == 2 and "--calibrate applies to --quantize svdq" in r.err


@pytest.mark.parametrize("family,precision", CASES)
def test_identity_is_kept_for_validate(written, family, precision):
    """The writer keeps the file's identity (over its stored, packed tensors) so validate need not read it: the
    kept one equals the identity recomputed from the header and raw bytes. The file's own sha256, which the writer
    does not take, is the one `port convert --quantize` takes for its manifest, recorded for publish and push."""
    import hashlib
    import struct

    from porting.known_digests import known_sha256, known_weights
    from porting.tensors.identity import WeightsHasher

    path = written[family, precision]["path"]
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    hasher = WeightsHasher()
    for key, info in header.items():
        if key != "__metadata__":
            a, b = info["data_offsets"]
            hasher.add(key, info["dtype"], tuple(info["shape"]), hashlib.sha256(raw[8 + n + a:8 + n + b]).hexdigest())
    assert known_weights([path]) == hasher.hexdigest()
    assert known_sha256(path) == hashlib.sha256(raw).hexdigest()
