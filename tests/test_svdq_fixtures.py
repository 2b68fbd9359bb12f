"""The SVDQuant fixture maker (tests/svdqfiles.py): its files are deepcompressor's bytes, its oracle fits them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from .svdqfiles import (
    FLUX2_CONFIG,
    SHIFT,
    _random_svdq_layer,
    _write_streamed,
    corrupt_tile,
    quantization_config,
    write_svdq_file,
)

pytest.importorskip("deepcompressor.backend.nunchaku.convert")
ROOT = Path(__file__).resolve().parents[1]


def load_all(fx) -> dict[str, torch.Tensor]:
    out = {}
    for f in fx.files:
        out.update(load_file(str(f)))
    return out


def repack(key: str, logical: torch.Tensor, stored: torch.Tensor, precision: str) -> torch.Tensor:
    """Pack the oracle's logical tensor with deepcompressor's packers, the way its converter does."""
    from deepcompressor.backend.nunchaku.utils import NunchakuWeightPacker
    from deepcompressor.backend.tinychat.utils import pack_w4

    part = key.rsplit(".", 1)[1]
    packer = NunchakuWeightPacker(bits=4)
    if stored.dtype == torch.int32:  # AWQ qweight
        return pack_w4(logical.to(torch.int32)).view(torch.int32)
    if part == "qweight":
        return packer.pack_weight(packer.pad_weight(logical.to(torch.int32)))
    if part == "wscales" and logical.dtype == torch.float8_e4m3fn:
        n, g = logical.shape
        sub = packer.pad_scale(logical.to(torch.bfloat16).view(n, 1, g, 1), group_size=16)
        return packer.pack_scale(sub, group_size=16)
    if part == "wscales":
        n, g = logical.shape
        return packer.pack_scale(packer.pad_scale(logical.view(n, 1, g, 1), group_size=64), group_size=64)
    if part in ("proj_down", "lora_down"):
        return packer.pack_lowrank_weight(packer.pad_lowrank_weight(logical, down=True), down=True)
    if part in ("proj_up", "lora_up"):
        return packer.pack_lowrank_weight(packer.pad_lowrank_weight(logical, down=False), down=False)
    if part == "wtscale":
        return logical
    # per-channel vectors: bias, smooth, smooth_orig, wcscales
    return packer.pack_scale(packer.pad_scale(logical.view(-1, 1), group_size=-1), group_size=-1)


CASES = [("flux1", "int4", False, "module", "single"), ("flux1", "nvfp4", True, "module", "split"),
         ("flux1", "int4", True, "module", "split"), ("flux2", "int4", False, "module", "single"),
         ("flux2", "nvfp4", False, "alias", "single"), ("flux2", "nvfp4", True, "module", "single")]


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")
@pytest.mark.parametrize("family,precision,fused,spelling,container", CASES)
def test_file_holds_the_oracle_parts(tmp_path, family, precision, fused, spelling, container):
    """Every packed tensor the converter wrote equals the oracle's logical tensor packed by deepcompressor."""
    fx = write_svdq_file(tmp_path, family, precision, rank=16, spelling=spelling, container=container,
                         smooth_fused=fused)
    stored = load_all(fx)
    awq = {k.rsplit(".", 1)[0] for k, v in stored.items() if k.endswith("qweight") and v.dtype == torch.int32}
    for key, logical in fx.parts.items():
        layer = key.rsplit(".", 1)[0]
        if layer in awq and not key.endswith("qweight"):
            if key.endswith("bias"):
                assert torch.equal(stored[key], logical), key
            else:  # (k/64 padded to 16 groups, n) in the file
                ng = logical.shape[1]
                assert torch.equal(stored[key][:ng].t(), logical), key
                assert not stored[key][ng:].any(), key
            continue
        got = repack(key, logical, stored[key], precision)
        assert got.dtype == stored[key].dtype, key
        assert torch.equal(got.reshape(-1).view(torch.uint8), stored[key].reshape(-1).view(torch.uint8)), key
    # every block tensor of the file is either an oracle part or a copied norm weight
    for key in stored:
        if key.startswith(("transformer_blocks.", "single_transformer_blocks.")):
            assert key in fx.parts or ".norm_" in key, key
    if fused:
        smooth = [k for k in fx.parts if k.endswith(("out_proj.smooth", "out_proj.smooth_factor",
                                                      "to_out.0.smooth_factor", "to_add_out.smooth_factor",
                                                      "out_proj_context.smooth"))]
        assert len(smooth) == 3 and all(torch.all(fx.parts[k] == 1) for k in smooth)
    if family == "flux2":
        biases = [v for k, v in stored.items() if k.endswith(".bias")]
        assert biases and all(not b.any() for b in biases)  # the converter's zero biases are kept


def effective_from_parts(fx) -> dict[str, torch.Tensor]:
    """svdquant.md sections 4-5 applied to the oracle's logical tensors (flux1 or flux2 alias names)."""
    parts, out = {k: v for k, v in fx.parts.items()}, {}
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)

    def svdq(name: str, shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        codes = parts[name + ".qweight"]
        if codes.dtype == torch.int8:
            r = codes.double() * parts[name + ".wscales"].double().repeat_interleave(64, 1)
        else:
            r = e2m1[codes.long()] * parts[name + ".wscales"].double().repeat_interleave(16, 1)
            r = r * (parts[name + ".wcscales"].double()[:, None] if name + ".wcscales" in parts
                     else parts[name + ".wtscale"].double())
        rs = r / parts[name + ".smooth"].double()
        w = rs + parts[name + ".lora_up"].double() @ parts[name + ".lora_down"].double()
        return w, parts[name + ".bias"].double() + (SHIFT * rs.sum(1) if shifted else 0)

    def awq(name: str, splits: int) -> None:
        q, sc, z = (parts[f"{name}.{p}"].double() for p in ("qweight", "wscales", "wzeros"))
        w = q * sc.repeat_interleave(64, 1) + z.repeat_interleave(64, 1)
        n = w.shape[0]
        out[name + ".weight"] = w.view(n // splits, splits, -1).transpose(0, 1).reshape(w.shape)
        b = parts[name + ".bias"].double().view(n // splits, splits).t().clone()
        b[1] -= 1
        if splits - 2 != 1:
            b[splits - 2] -= 1
        out[name + ".bias"] = b.reshape(n)

    def put(name: str, wb: tuple[torch.Tensor, torch.Tensor], bias: bool) -> None:
        out[name + ".weight"] = wb[0]
        if bias:
            out[name + ".bias"] = wb[1]

    def thirds(name: str, targets: list[str], bias: bool) -> None:
        w, b = svdq(name)
        for j, t in enumerate(targets):
            put(t, (w.chunk(3)[j], b.chunk(3)[j]), bias)

    shift = fx.family == "flux1" and fx.precision == "int4"
    one = fx.family == "flux1"  # FLUX.1 linears have biases, FLUX.2 ones do not
    for i in range(fx.config["num_layers"]):
        b = f"transformer_blocks.{i}."
        if one:
            awq(b + "norm1.linear", 6)
            awq(b + "norm1_context.linear", 6)
        thirds(b + "qkv_proj", [b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"], one)
        thirds(b + "qkv_proj_context", [b + "attn.add_q_proj", b + "attn.add_k_proj", b + "attn.add_v_proj"], one)
        put(b + "attn.to_out.0", svdq(b + "out_proj"), one)
        put(b + "attn.to_add_out", svdq(b + "out_proj_context"), one)
        ff = (("ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2") if one else
              ("ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"))
        for local, target in zip(("mlp_fc1", "mlp_fc2", "mlp_context_fc1", "mlp_context_fc2"), ff):
            put(b + target, svdq(b + local, shift and local.endswith("fc2")), one)
    for i in range(fx.config["num_single_layers"]):
        b = f"single_transformer_blocks.{i}."
        w_o, b_o = svdq(b + "out_proj")
        w_2, b_2 = svdq(b + "mlp_fc2", shift)
        if one:
            awq(b + "norm.linear", 3)
            thirds(b + "qkv_proj", [b + "attn.to_q", b + "attn.to_k", b + "attn.to_v"], True)
            put(b + "proj_mlp", svdq(b + "mlp_fc1"), True)
            put(b + "proj_out", (torch.cat([w_o, w_2], 1), b_o + b_2), True)
        else:
            out[b + "attn.to_qkv_mlp_proj.weight"] = torch.cat([svdq(b + "qkv_proj")[0], svdq(b + "mlp_fc1")[0]])
            out[b + "attn.to_out.weight"] = torch.cat([w_o, w_2], 1)
    return out


@pytest.mark.parametrize("family,precision,fused", [("flux1", "int4", False), ("flux1", "nvfp4", True),
                                                    ("flux2", "int4", True), ("flux2", "nvfp4", False)])
def test_expected_follows_from_the_parts(tmp_path, family, precision, fused):
    """A second path from the logical tensors to diffusers names (the reader's equations) lands on `expected`."""
    fx = write_svdq_file(tmp_path, family, precision, spelling="alias", smooth_fused=fused)
    got = effective_from_parts(fx)
    for key, value in fx.expected.items():
        if key in got:
            assert torch.allclose(got[key].float(), value, rtol=1e-6, atol=1e-7), key
        else:
            assert ".norm_" in key or not key.startswith(("transformer_blocks.", "single_transformer_blocks.")), key


def forward(family: str, config: dict, state: dict[str, torch.Tensor]) -> torch.Tensor:
    from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

    cls = FluxTransformer2DModel if family == "flux1" else Flux2Transformer2DModel
    model = cls.from_config(config).to(torch.bfloat16).eval()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=True)
    g = torch.Generator().manual_seed(5)
    img, txt = 16, 8
    axes = len(config["axes_dims_rope"])
    kw = dict(hidden_states=torch.randn(1, img, config["in_channels"], generator=g).to(torch.bfloat16),
              encoder_hidden_states=torch.randn(1, txt, config["joint_attention_dim"], generator=g).to(torch.bfloat16),
              timestep=torch.tensor([0.5]), img_ids=torch.arange(img * axes).view(img, axes) % 7,
              txt_ids=torch.zeros(txt, axes), return_dict=False)
    if family == "flux1":
        kw["pooled_projections"] = torch.randn(1, config["pooled_projection_dim"], generator=g).to(torch.bfloat16)
        kw["guidance"] = torch.tensor([3.5])
    with torch.no_grad():
        return model(**kw)[0].float()


@pytest.mark.parametrize("family,precision", [("flux1", "int4"), ("flux1", "nvfp4"), ("flux2", "int4"),
                                              ("flux2", "nvfp4")])
def test_expected_is_a_loadable_model_close_to_the_original(tmp_path, family, precision):
    fx = write_svdq_file(tmp_path, family, precision, rank=16)
    assert fx.family == family and fx.precision == precision and fx.rank == 16 and fx.files == [fx.path]
    assert fx.config["_class_name"] == ("FluxTransformer2DModel" if family == "flux1" else "Flux2Transformer2DModel")
    assert set(fx.expected) == set(fx.original)
    quantized = 0
    for key, exp in fx.expected.items():
        orig = fx.original[key]
        assert exp.dtype == torch.float32 and exp.shape == orig.shape, key
        if exp.ndim == 2 and key.startswith(("transformer_blocks.", "single_transformer_blocks.")):
            quantized += 1
            rel = ((exp - orig).norm() / orig.norm()).item()
            assert 0 < rel < 0.2, (key, rel)
        elif ".norm1" in key or ".norm.linear" in key:  # AWQ adaLN bias: bf16(b + 1) - 1 on the scale slots
            assert (exp - orig).abs().max() <= 2**-7, key
        elif key.endswith(".bias") and key.startswith(("transformer_blocks.", "single_transformer_blocks.")):
            if not (precision == "int4" and (".net.2." in key or "proj_out" in key)):
                assert torch.equal(exp, orig), key  # plain bias: stored as given
        else:
            assert torch.equal(exp, orig), key  # unquantized: as stored
    assert quantized == (20 if family == "flux1" else 14)
    ref = forward(family, fx.config, fx.original)
    out = forward(family, fx.config, fx.expected)
    assert torch.isfinite(out).all()
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < 0.5, rel


def test_shift_bias_rule_int4_flux1(tmp_path):
    """b_eff = b_file + 0.171875·rowsum(R/s) gives back b plus the shift times the row's quantization error."""
    for precision in ("int4", "nvfp4"):
        fx = write_svdq_file(tmp_path / precision, "flux1", precision)
        d, s = "transformer_blocks.0.", "single_transformer_blocks.0."
        for w_key, cols, layer in ((d + "ff.net.2.weight", slice(None), d + "mlp_fc2"),
                                   (d + "ff_context.net.2.weight", slice(None), d + "mlp_context_fc2"),
                                   (s + "proj_out.weight", slice(128, None), s + "mlp_fc2")):
            b_key = w_key[: -len("weight")] + "bias"
            w, w_eff = fx.original[w_key][:, cols].double(), fx.expected[w_key][:, cols].double()
            b, b_eff = fx.original[b_key].double(), fx.expected[b_key].double()
            if precision == "nvfp4":
                assert torch.equal(b_eff, b)  # no shift in nvfp4
                continue
            want = b + SHIFT * (w_eff - w).sum(dim=1)
            up, down = fx.parts[layer + ".lora_up"].double(), fx.parts[layer + ".lora_down"].double()
            b_file = fx.parts[layer + ".bias"].double()
            # bf16 roundings: the ShiftedLinear bias, the file bias, lora_down / s (the converter uses it unrounded)
            tol = 2.0**-8 * ((b - SHIFT * w.sum(dim=1)).abs() + b_file.abs() + SHIFT * (up.abs() @ down.abs()).sum(1))
            assert ((b_eff - want).abs() <= tol + 1e-7).all(), w_key
            assert (b_eff - b).abs().max() > 1e-3  # the shift correction is there (and is not the whole bias)


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_fused_smoothing(tmp_path, family):
    plain = write_svdq_file(tmp_path / "plain", family, "int4")
    fused = write_svdq_file(tmp_path / "fused", family, "int4", smooth_fused=True)
    assert not plain.fusion and len(fused.fusion) == 3
    undone = fused.unfused()
    for out_key, cols, vs, s in fused.fusion:
        o = fused.original[out_key][:, cols]
        rel_fused = (fused.expected[out_key][:, cols] - o).norm() / o.norm()
        rel_undone = (undone[out_key][:, cols] - o).norm() / o.norm()
        assert rel_undone < 0.2 < rel_fused, out_key
        for v_key, rows in vs:
            o = fused.original[v_key][rows]
            assert ((undone[v_key][rows] - o).norm() / o.norm()) < 0.2
            assert ((fused.expected[v_key][rows] - o).norm() / o.norm()) > 0.2
    out = forward(family, fused.config, fused.expected)  # the fused network computes the same function
    ref = forward(family, fused.config, fused.original)
    assert ((out - ref).norm() / ref.norm()) < 0.5


def test_metadata_split_and_no_metadata(tmp_path):
    fx = write_svdq_file(tmp_path, "flux1", "nvfp4", rank=32)
    assert fx.path.name == "svdq-fp4_r32-flux.1-tiny.safetensors"
    with safe_open(str(fx.path), "pt") as f:
        meta = f.metadata()
    assert meta == fx.metadata
    assert json.loads(meta["config"]) == fx.config and meta["model_class"] == "NunchakuFluxTransformer2dModel"
    assert meta["comfy_config"] == "{}"
    assert json.loads(meta["quantization_config"]) == {
        "method": "svdquant", "weight": {"dtype": "fp4_e2m1_all", "scale_dtype": [None, "fp8_e4m3_nan"],
                                         "group_size": 16},
        "activation": {"dtype": "fp4_e2m1_all", "scale_dtype": "fp8_e4m3_nan", "group_size": 16}, "rank": 32}

    f2 = write_svdq_file(tmp_path, "flux2", "int4")
    assert f2.path.name == "svdq-int4_r16-flux.2-klein-tiny.safetensors"
    assert f2.metadata["model_class"] == "NunchakuFlux2Transformer2DModel" and "comfy_config" not in f2.metadata
    assert json.loads(f2.metadata["quantization_config"]) == quantization_config("int4", 16)
    assert json.loads(f2.metadata["quantization_config"])["weight"] == {"dtype": "int4", "scale_dtype": None,
                                                                        "group_size": 64}

    split = write_svdq_file(tmp_path / "s", "flux1", "int4", container="split")
    assert split.path.is_dir() and [p.name for p in split.files] == ["transformer_blocks.safetensors",
                                                                     "unquantized_layers.safetensors"]
    assert json.loads((split.path / "config.json").read_text()) == split.config
    for f in split.files:
        with safe_open(str(f), "pt") as h:
            assert not h.metadata()
    with safe_open(str(split.files[1]), "pt") as h:
        assert not any(k.startswith(("transformer_blocks.", "single_transformer_blocks.")) for k in h.keys())

    bare = write_svdq_file(tmp_path / "bare", "flux2", "int4", metadata=False)
    with safe_open(str(bare.path), "pt") as h:
        assert not h.metadata()
    with pytest.raises(ValueError):
        write_svdq_file(tmp_path, "flux2", "int4", container="split")


def test_deterministic_for_a_seed(tmp_path):
    a = write_svdq_file(tmp_path / "a", "flux2", "nvfp4", seed=3)
    b = write_svdq_file(tmp_path / "b", "flux2", "nvfp4", seed=3)
    c = write_svdq_file(tmp_path / "c", "flux2", "nvfp4", seed=4)
    assert a.path.read_bytes() == b.path.read_bytes() != c.path.read_bytes()


def test_corrupt_tile(tmp_path):
    fx = write_svdq_file(tmp_path, "flux2", "int4")
    key = "single_transformer_blocks.0.attn.mlp_fc1.qweight"
    before = {k: v.clone() for k, v in load_file(str(fx.path)).items()}
    head = fx.path.read_bytes()[:64]
    corrupt_tile(fx.path, key)
    after = load_file(str(fx.path))
    assert fx.path.read_bytes()[:64] == head
    for k in before:
        if k != key:
            assert torch.equal(before[k], after[k]), k
    old, new = before[key].reshape(-1).view(torch.uint8), after[key].reshape(-1).view(torch.uint8)
    assert torch.equal(new[:4096], 255 - old[:4096]) and torch.equal(new[4096:], old[4096:])
    with pytest.raises(KeyError):
        corrupt_tile(fx.path, "transformer_blocks.0.attn.to_qkv.wscales")


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")
@pytest.mark.parametrize("precision,pieces", [("int4", 1), ("nvfp4", 1), ("nvfp4", 3)])
def test_row_chunks_pack_like_the_whole_layer(precision, pieces):
    """The streamed writer's premise: the converter's outputs for row chunks concatenate to the whole layer's."""
    from deepcompressor.backend.nunchaku.convert import convert_to_nunchaku_w4x4y16_linear_state_dict

    n, k, r = 384, 256, 16
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    s = (0.5 + torch.rand(k, generator=g)).to(torch.bfloat16)
    down, up = torch.randn(r, k, generator=g).to(torch.bfloat16), torch.randn(n, r, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    if precision == "int4":
        scale, sub = (w.float().abs().view(n, 1, k // 64, 64).amax(-1, keepdim=True) / 7).to(torch.bfloat16), None
        scale = scale.view(n, 1, k // 64, 1)
    else:
        t = torch.tensor([1e-4, 2e-4, 3e-4]).to(torch.bfloat16)
        scale = t[:pieces].repeat_interleave(n // pieces).view(n, 1, 1, 1) if pieces > 1 else t[:1].view(1, 1, 1, 1)
        sub = (w.float().abs().view(n, 1, k // 16, 16).amax(-1, keepdim=True) / 6
               / scale.float().view(-1, 1, 1, 1)).clamp(2**-9, 448).to(torch.float8_e4m3fn).to(torch.bfloat16)
        sub = sub.view(n, 1, k // 16, 1)

    def conv(rows: slice) -> dict[str, torch.Tensor]:
        sc = scale if scale.numel() == 1 else scale[rows]
        return convert_to_nunchaku_w4x4y16_linear_state_dict(
            weight=w[rows], scale=sc, bias=bias[rows], smooth=s, lora=(down, up[rows]),
            float_point=precision == "nvfp4", subscale=None if sub is None else sub[rows])

    whole = conv(slice(None))
    chunks = [conv(slice(i, i + 128)) for i in range(0, n, 128)]
    for part, value in whole.items():
        if part in ("smooth", "smooth_orig", "lora_down", "wtscale"):
            assert all(torch.equal(c[part], value) for c in chunks), part
        else:
            cat = torch.cat([c[part].reshape(-1).view(torch.uint8) for c in chunks])
            assert torch.equal(cat, value.reshape(-1).view(torch.uint8)), part


@pytest.mark.parametrize("precision", ["int4", "nvfp4"])
def test_streamed_writer_has_the_tiny_layout(tmp_path, precision):
    """The klein-9B writer, run at the tiny FLUX.2 shapes, writes the keys/dtypes/shapes of the tiny fixture."""
    tiny = write_svdq_file(tmp_path / "tiny", "flux2", precision, rank=32)
    streamed = _write_streamed(tmp_path / "streamed.safetensors", FLUX2_CONFIG, precision, 32, seed=0,
                               chunk_rows=128)

    def layout(path):
        with safe_open(str(path), "pt") as f:
            return {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}, f.metadata()

    (a, meta_a), (b, meta_b) = layout(tiny.path), layout(streamed)
    assert a == b and meta_a == meta_b
    data = load_file(str(streamed))
    assert all(torch.isfinite(v.float()).all() for v in data.values())


def test_random_layer_chunks():
    g = torch.Generator().manual_seed(0)
    packed = _random_svdq_layer(384, 256, 16, "nvfp4", 3, g, 128)
    counts = [len(packed[p]) for p in ("qweight", "wcscales", "wscales", "lora_up", "smooth", "lora_down")]
    assert counts == [3, 3, 3, 3, 1, 1] and "wtscale" not in packed


@pytest.mark.slow
def test_klein9b_shaped_streams_within_memory(tmp_path):
    """One double and one single block at klein-9B width, in a child process: peak RSS well under 3 GiB."""
    out = tmp_path / "k9.safetensors"
    code = ("import resource, sys; sys.path.insert(0, %r); from tests.svdqfiles import write_klein9b_shaped; "
            "write_klein9b_shaped(%r, 'int4', 32, blocks=(1, 1)); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)" % (str(ROOT), str(out)))
    run = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True)
    peak = int(run.stdout.split()[-1]) * 1024
    assert peak < 2.5 * 2**30, peak
    with safe_open(str(out), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("single_transformer_blocks.0.attn.mlp_fc1.qweight").get_shape() == [24576, 2048]
        assert f.get_slice("transformer_blocks.0.ff.linear_out.wscales").get_shape() == [192, 4096]
        assert json.loads(f.metadata()["config"])["num_single_layers"] == 1
    assert "transformer_blocks.0.attn.to_qkv.proj_down" in keys and "context_embedder.weight" in keys
