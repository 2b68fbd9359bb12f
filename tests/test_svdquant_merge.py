"""`port merge SVDQ_FILE ADAPTER...`: adapters appended to the low-rank branch of a Nunchaku SVDQuant file.

The bases are made by deepcompressor's own converter (tests/svdqfiles.py); the deltas by the test's own arithmetic
(tests/lorakit.py `Part.delta`). The merged file, read back through the reader, must equal the base's weights plus
each delta; the layers no adapter touches must keep every stored tensor byte for byte, their branch padded with
zeros to the common rank.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from .helpers import leftovers, run_port
from .lorakit import BY_NAME, Part, make_parts, write_adapter

pytest.importorskip("deepcompressor.backend.nunchaku.convert",
                    reason="the oracle: pip install --no-deps deepcompressor-toolkit==0.1.0 (as .ci/run does)")

from .svdqfiles import write_svdq_file  # noqa: E402

# FLUX.2: a fused-qkv piece (split rows), the single block's rows join and columns join, an MLP layer, a 16-bit one
FLUX2_MODULES = ["transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
                 "single_transformer_blocks.0.attn.to_out", "transformer_blocks.0.ff.linear_out", "x_embedder"]
KIND_NAMING = {"lora": "peft-transformer", "lokr": "lycoris-lokr", "loha": "kohya-loha", "diff": "comfy-diff"}


def _view(path: Path):
    from porting.inputs import open_source

    return open_source(path, kind="weights").detection.ckpt


def _raw(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def flux2_base(tmp_path_factory):
    return write_svdq_file(tmp_path_factory.mktemp("svdq-base2"), "flux2", "int4", rank=16)


def _shapes(view) -> dict[str, tuple[int, int]]:
    return {k[: -len(".weight")]: tuple(v.shape) for k, v in view.tensors.items()
            if k.endswith(".weight") and len(v.shape) == 2}


def _merged_file(out: Path) -> Path:
    (path,) = [p for p in out.glob("*.safetensors")]
    return path


def _check(base: Path, merged: Path, deltas: dict[str, torch.Tensor], rtol: float) -> None:
    """Every weight of `merged` = base + delta (touched) or = base (untouched), through the reader."""
    b, m = _view(base), _view(merged)
    assert set(b.tensors) == set(m.tensors)
    for key in b.tensors:
        want = b.read(key).float()
        got = m.read(key).float()
        d = deltas.get(key[: -len(".weight")]) if key.endswith(".weight") else None
        if d is None:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda s: f"{key}: {s}")
            continue
        err = float((got - (want + d)).norm())
        if not b.tensors[key].computed:  # a 16-bit tensor: the sum rounded to its dtype once, as port merge does
            assert torch.equal(got, (want + d).to(torch.bfloat16).float()), key
            continue
        assert err <= rtol * float(d.norm()) + 1e-5 * float(want.norm()), (key, err, float(d.norm()))


def _lowrank_parts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k.endswith((".proj_down", ".proj_up", ".lora_down", ".lora_up"))}


@pytest.mark.parametrize("kind", ["lora", "lokr", "loha"])
def test_merged_reads_back_as_base_plus_delta(flux2_base, tmp_path, capsys, kind):
    from porting.tensors.quant.svdq.tiles import unpack_lowrank

    view = _view(flux2_base.path)
    modules = FLUX2_MODULES if kind == "lora" else FLUX2_MODULES[:4]
    parts = make_parts(_shapes(view), modules, kind, seed=2, rank=4, alpha=None)
    naming = BY_NAME[KIND_NAMING[kind]]
    adapter = write_adapter(tmp_path / f"{kind}.safetensors", naming, parts, dtype=torch.bfloat16)
    parts = [Part(p.module, p.kind, {k: v.to(torch.bfloat16).float() for k, v in p.factors.items()}, p.alpha)
             for p in parts]  # the factors as the file stores them
    r = run_port(capsys, "merge", flux2_base.path, adapter, "--out", tmp_path / "out", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    merged = _merged_file(tmp_path / "out")
    # exact: a LoRA's own factors (bf16, multiplier 1); LoKr / LoHa of rank <= 8 by SVD to float32 rounding, then
    # bf16 factors
    _check(flux2_base.path, merged, {p.module: p.delta() for p in parts}, rtol=1e-6 if kind == "lora" else 2e-2)
    svdq = doc["svdq_merge"]
    assert svdq["base_rank"] == 16 and svdq["rank"] % 16 == 0 and svdq["rank"] > 16
    if kind != "lora":
        assert svdq["factorised"] and all(row["rel_error"] < 1e-3 for row in svdq["factorised"])
    base, _ = _raw(flux2_base.path)
    got, meta = _raw(merged)
    assert json.loads(meta["quantization_config"])["rank"] == svdq["rank"]
    assert merged.name == f"svdq-int4_r{svdq['rank']}-flux.2-klein-tiny.safetensors"
    assert json.loads(meta["flux_port_merged"])[0]["adapter"] == adapter.name
    # every tensor but the branches: the same bytes; branches: the base's first, the rest zeros where untouched
    for key, t in base.items():
        if key in _lowrank_parts(base) or key == "x_embedder.weight":  # x_embedder: a 16-bit tensor, merged
            continue
        assert torch.equal(t.view(torch.uint8), got[key].view(torch.uint8)), key
    r = run_port(capsys, "inspect", merged, "--json")
    details = json.loads(r.out)["quantization"]["details"]
    assert details["rank"] == svdq["rank"] and details["merged_adapters"][0]["adapter"] == adapter.name
    untouched = "transformer_blocks.0.attn.to_add_out"
    for part, down in (("proj_down", True), ("proj_up", False)):
        old = unpack_lowrank(base[f"{untouched}.{part}"], down)
        new = unpack_lowrank(got[f"{untouched}.{part}"], down)
        old_cols, new_cols = (old, new) if not down else (old.t(), new.t())
        assert torch.equal(new_cols[:, :16], old_cols) and not new_cols[:, 16:].any()


def test_bfl_named_lora_through_a_table_step_is_exact(flux2_base, tmp_path, capsys):
    """kohya keys on BFL modules: the delta reaches the diffusers tensor through the table, dense; its SVD finds
    the LoRA's rank and the merge is exact to float32 rounding."""
    view = _view(flux2_base.path)
    shapes = {"double_blocks.0.img_attn.proj": _shapes(view)["transformer_blocks.0.attn.to_out.0"]}
    parts = make_parts(shapes, list(shapes), "lora", seed=5, rank=3, alpha=None)
    adapter = write_adapter(tmp_path / "kohya.safetensors", BY_NAME["kohya"], parts)
    r = run_port(capsys, "merge", flux2_base.path, adapter, "--out", tmp_path / "out", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    (row,) = doc["svdq_merge"]["factorised"]
    assert row["rank"] == 3 and row["rel_error"] < 1e-5
    _check(flux2_base.path, _merged_file(tmp_path / "out"),
           {"transformer_blocks.0.attn.to_out.0": parts[0].delta()}, rtol=1e-2)


def test_full_delta_truncated_within_max_error(flux2_base, tmp_path, capsys):
    view = _view(flux2_base.path)
    parts = make_parts(_shapes(view), ["transformer_blocks.0.ff.linear_out"], "diff", seed=3)
    adapter = write_adapter(tmp_path / "diff.safetensors", BY_NAME["comfy-diff"], parts)
    r = run_port(capsys, "merge", flux2_base.path, adapter, "--out", tmp_path / "out", "--max-error", "0.5", "--json")
    assert r.code == 0, r.err
    (row,) = json.loads(r.out)["svdq_merge"]["factorised"]
    assert 0 < row["rel_error"] <= 0.5 and row["rank"] < 128
    _check(flux2_base.path, _merged_file(tmp_path / "out"), {parts[0].module: parts[0].delta()},
           rtol=row["rel_error"] * 1.01 + 1e-2)


def test_flux1_awq_layer_is_requantized_and_others_appended(tmp_path, capsys):
    base = write_svdq_file(tmp_path / "b1", "flux1", "nvfp4", rank=16)
    view = _view(base.path)
    modules = ["transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.proj_out",
               "transformer_blocks.0.norm1.linear"]
    parts = make_parts(_shapes(view), modules, "lora", seed=4, rank=4, alpha=None)
    adapter = write_adapter(tmp_path / "l.safetensors", BY_NAME["peft-transformer"], parts, dtype=torch.bfloat16)
    parts = [Part(p.module, p.kind, {k: v.to(torch.bfloat16).float() for k, v in p.factors.items()}, p.alpha)
             for p in parts]
    r = run_port(capsys, "merge", base.path, adapter, "--out", tmp_path / "out", "--json")
    assert r.code == 0, r.err
    doc = json.loads(r.out)
    assert doc["svdq_merge"]["requantized"] == ["transformer_blocks.0.norm1.linear"]
    assert "quantized again" in r.err
    deltas = {p.module: p.delta() for p in parts[:2]}
    merged = _merged_file(tmp_path / "out")
    b, m = _view(base.path), _view(merged)
    for key in ("transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.proj_out"):
        want = b.read(key + ".weight").float() + deltas[key]
        torch.testing.assert_close(m.read(key + ".weight").float(), want, rtol=1e-5, atol=1e-5)
    key = "transformer_blocks.0.norm1.linear.weight"
    want = b.read(key).float() + parts[2].delta()
    assert float((m.read(key).float() - want).norm()) < 0.1 * float(want.norm())  # 4-bit rounding again
    torch.testing.assert_close(m.read("transformer_blocks.0.norm1.linear.bias"),
                               b.read("transformer_blocks.0.norm1.linear.bias"))


def test_requantize_keeps_the_rank(flux2_base, tmp_path, capsys):
    view = _view(flux2_base.path)
    parts = make_parts(_shapes(view), FLUX2_MODULES, "lora", seed=6, rank=4, alpha=None)
    adapter = write_adapter(tmp_path / "l.safetensors", BY_NAME["peft-transformer"], parts)
    r = run_port(capsys, "merge", flux2_base.path, adapter, "--out", tmp_path / "out", "--requantize", "--json")
    assert r.code == 0, r.err
    merged = _merged_file(tmp_path / "out")
    _, meta = _raw(merged)
    assert json.loads(meta["quantization_config"])["rank"] == 16
    assert json.loads(meta["merged_adapters"])[0]["strength"] == 1.0
    b, m = _view(flux2_base.path), _view(merged)
    key = "transformer_blocks.0.ff.linear_out.weight"
    want = b.read(key).float() + parts[3].delta()
    assert float((m.read(key).float() - want).norm()) < 0.15 * float(want.norm())


def test_refusals(flux2_base, tmp_path, capsys, tiny2_file):
    view = _view(flux2_base.path)
    parts = make_parts(_shapes(view), ["transformer_blocks.0.attn.to_q"], "lora", seed=1, rank=2)
    adapter = write_adapter(tmp_path / "l.safetensors", BY_NAME["peft-transformer"], parts)
    r = run_port(capsys, "merge", flux2_base.path, adapter, "--out", tmp_path / "o1", "--to", "original")
    assert r.code == 2 and "--to" in r.err and leftovers(tmp_path / "o1") == []
    r = run_port(capsys, "merge", flux2_base.path, adapter, "--out", tmp_path / "o2", "--max-error", "2")
    assert r.code == 2 and "--max-error 2" in r.err
    r = run_port(capsys, "merge", flux2_base.path, adapter, "--out", tmp_path / "o3", "--requantize",
                 "--max-error", "0.1")
    assert r.code == 2 and "one of the two" in r.err
    bfl = make_parts({"double_blocks.0.img_attn.proj": (64, 64)}, ["double_blocks.0.img_attn.proj"], "lora")
    r = run_port(capsys, "merge", tiny2_file, write_adapter(tmp_path / "b.safetensors", BY_NAME["kohya"], bfl),
                 "--out", tmp_path / "o4", "--requantize")
    assert r.code == 2 and "SVDQuant bases" in r.err and leftovers(tmp_path / "o4") == []
