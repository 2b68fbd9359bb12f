"""Models built without memory (porting/skeleton.py) leave the tensors that imports make alone, and stay small.

`with torch.device("meta")` switched torch's default device: a module imported for the first time inside the block
made its module-level tensors on the meta device for the rest of the process (diffusers' BFL-scheme lookup table, so
every later nvfp4 dequantization failed). Each case runs in a fresh interpreter, since the bug depends on which import
comes first."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _child(case: str) -> dict:
    run = subprocess.run([sys.executable, "-m", "tests.skeleton_child", case], cwd=ROOT, capture_output=True,
                         text=True)
    assert run.returncode == 0, f"{case}: the child failed:\n{run.stderr[-3000:]}"
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", [
    "count_meta",  # porting's path (the export's parameter counter), at klein-9B size
    pytest.param("svdq_fixture", marks=pytest.mark.slow),  # the fixture path that broke the oracle; a second ~10 s
])
def test_a_skeleton_built_first_leaves_the_bfl_lookup_table_on_the_cpu(case: str) -> None:
    out = _child(case)
    assert out["table_device"] == "cpu" and out["oracle_devices"] == ["cpu"], out
    # nvfp4 / fp8r of a Gaussian weight: about 10% / 3% relative error; a wrong table gives ~100%
    assert out["errors"]["single_blocks.0.linear1.weight"] < 0.2, out
    assert out["errors"]["double_blocks.0.img_attn.qkv.weight"] < 0.05, out
    if case == "count_meta":  # klein-9B (18 GB in bf16) and Qwen3-8B (16 GB): none of it allocated
        assert (out["params"], out["text_params"]) == (9_078_581_248, 8_190_735_360)
        # below the largest single parameter of either in float32 (klein-9B's linear1: 604 MB); with the imports the
        # build makes (about 150 MB), the weights 0
        assert out["peak_growth"] < 512 * 2**20 and out["text_peak_growth"] < 512 * 2**20, out


def _meta_device_blocks(tree: ast.AST) -> list[int]:
    """Lines of `with torch.device("meta")`, of direct calls to accelerate's init_empty_weights / init_on_device, and
    of `to_empty` (which wipes the buffers a skeleton computed: porting.skeleton.materialise)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "device"
                        and any(isinstance(a, ast.Constant) and a.value == "meta" for a in call.args)):
                    lines.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "init_empty_weights", "init_on_device", "to_empty"):
            lines.append(node.lineno)
    return lines


def test_every_skeleton_is_built_by_porting_skeleton() -> None:
    """No `with torch.device("meta")` left, and accelerate's context called in one place (porting/skeleton.py)."""
    found = []
    for folder in ("porting", "validation", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "porting" / "skeleton.py":
                continue
            found += [f"{path.relative_to(ROOT)}:{n}" for n in _meta_device_blocks(ast.parse(path.read_text()))]
    assert not found, f"build and materialise these through porting.skeleton (empty_weights / diffusers_skeleton / " \
                      f"materialise): {found}"


# ---------------------------------------------------------------- materialise: memory for the meta tensors only

class _Allocations:
    """The allocations torch makes while it is entered (factory and copy ops through a dispatch mode): (op, dtype,
    element count) for each."""

    ALLOCATING = ("aten.empty", "aten.empty_strided", "aten._to_copy", "aten.clone", "aten.zeros", "aten.ones")

    def __enter__(self) -> list[tuple[str, torch.dtype, int]]:
        from torch.utils._python_dispatch import TorchDispatchMode

        seen: list[tuple[str, torch.dtype, int]] = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                out = func(*args, **(kwargs or {}))
                name = str(func.overloadpacket)
                if name in _Allocations.ALLOCATING and isinstance(out, torch.Tensor) and not out.is_meta:
                    seen.append((name, out.dtype, out.numel()))
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return seen

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


def _tiny_qwen3(skeleton: bool) -> torch.nn.Module:
    """The tiny demo text encoder (porting.demo.tinypipe), built as bench/offload.py builds its text encoder (through
    the skeleton) or normally."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from porting.demo.tinypipe import TINY_TEXT_ENCODER
    from porting.skeleton import empty_weights

    config = Qwen3Config(**{**TINY_TEXT_ENCODER, "num_hidden_layers": 2})
    if not skeleton:
        return Qwen3ForCausalLM(config)
    with empty_weights():
        return Qwen3ForCausalLM(config)


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.clone() for name, b in module.named_buffers()}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_materialised_qwen3_keeps_its_rotary_tables_bit_equal_to_a_normal_build(dtype) -> None:
    """to_empty (what bench/offload.py did) replaced Qwen3's inv_freq by uninitialised memory."""
    from porting.skeleton import materialise

    normal = _tiny_qwen3(skeleton=False)
    normal = normal if dtype is None else normal.to(dtype)
    model = _tiny_qwen3(skeleton=True)
    assert {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"} <= set(_buffers(model))
    assert materialise(model, "cpu", dtype) is model
    want = _buffers(normal)
    got = _buffers(model)
    assert got.keys() == want.keys()
    for name, buffer in want.items():  # bit-equal: same dtype, same bytes
        assert got[name].dtype == buffer.dtype and torch.equal(got[name].view(torch.uint8),
                                                               buffer.view(torch.uint8)), name
    for name, p in model.named_parameters():
        assert not p.is_meta and p.dtype == (dtype or torch.float32) and isinstance(p, torch.nn.Parameter), name


def test_materialised_flux2_vae_keeps_its_batch_norm_statistics() -> None:
    """AutoencoderKLFlux2's `bn` statistics (running mean 0, variance 1, 0 batches tracked) are computed at init."""
    from diffusers import AutoencoderKLFlux2

    from porting.demo.tinypipe import TINY_VAE
    from porting.skeleton import diffusers_skeleton, materialise

    normal = AutoencoderKLFlux2(**TINY_VAE)
    vae = materialise(diffusers_skeleton(AutoencoderKLFlux2, TINY_VAE), "cpu", torch.float32)
    want, got = _buffers(normal), _buffers(vae)
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= want.keys() == got.keys()
    for name, buffer in want.items():
        assert got[name].dtype == buffer.dtype and torch.equal(got[name], buffer), name


def test_materialise_allocates_each_parameter_once_at_its_dtype_and_keeps_ties() -> None:
    """A meta parameter is allocated once, in the target dtype (to_empty then .to(bf16) made a float32 copy of every
    parameter first); a tied pair stays one tensor; a tensor already on the device in its dtype is not copied."""
    from porting.skeleton import materialise

    model = _tiny_qwen3(skeleton=True)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as a load ties them
    params = list(model.parameters())  # unique tensors
    with _Allocations() as seen:
        materialise(model, "cpu", torch.bfloat16)
    floats = sum(p.numel() for p in params)
    made = [(op, dtype, n) for op, dtype, n in seen if dtype == torch.bfloat16 and op != "aten._to_copy"]
    assert sum(n for _, _, n in made) == floats and len(made) == len(params), seen
    assert not [s for s in seen if s[1] == torch.float32 and s[2] > 64], seen  # no float32 copy of a weight
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # the only casts are the two float32 rotary buffers, as module.to(torch.bfloat16) casts them
    assert sorted(n for op, _, n in seen if op == "aten._to_copy") == [4, 4]
    with _Allocations() as again:
        materialise(model, "cpu", torch.bfloat16)
    assert again == []


def test_release_frees_the_parameters_and_keeps_the_buffers() -> None:
    from porting.skeleton import materialise, release

    model = materialise(_tiny_qwen3(skeleton=True), "cpu")
    tables = _buffers(model)
    assert release(model) is model
    assert all(p.is_meta for p in model.parameters())
    for name, buffer in tables.items():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name
    materialise(model, "cpu")
    assert not any(p.is_meta for p in model.parameters())
    for name, buffer in tables.items():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name


def test_ryzenai_hollow_keeps_the_rotary_tables() -> None:
    """`hollow` zeroed every buffer, so the streamed text encoder rebuilt its rotary modules afterwards."""
    from porting.export.ryzenai import hollow

    model = _tiny_qwen3(skeleton=True)
    tables = _buffers(model)
    hollow(model)
    assert all(p.stride() == (0,) * p.ndim for p in model.parameters())
    for name, buffer in tables.items():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name


@pytest.mark.slow
def test_bench_offload_synthetic_pipeline_builds_through_materialise(tmp_path) -> None:
    """bench/offload.py's synthetic pipeline (not run in CI otherwise) at the tiny geometry: the text encoder saved is
    what `fill_` writes into a normally built Qwen3, its embeddings tied; about 8 s (the full-size FLUX.2 VAE)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from porting.demo.tinypipe import TINY_BASE_TRANSFORMER, TINY_TEXT_ENCODER

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import offload
    finally:
        sys.path.remove(str(ROOT / "bench"))
    text = {k: v for k, v in TINY_TEXT_ENCODER.items() if k != "max_position_embeddings"}
    transformer = {k: v for k, v in TINY_BASE_TRANSFORMER.items() if not k.startswith("_")}
    folder = offload.build_synthetic(tmp_path / "pipe", transformer, text)
    saved = Qwen3ForCausalLM.from_pretrained(folder / "text_encoder", dtype=torch.bfloat16)
    assert saved.lm_head.weight.data_ptr() == saved.model.embed_tokens.weight.data_ptr()
    normal = Qwen3ForCausalLM(Qwen3Config(**text, max_position_embeddings=40960)).to(torch.bfloat16)
    offload.fill_(normal, 2)
    want = normal.state_dict()
    for name, tensor in saved.state_dict().items():
        assert torch.equal(tensor, want[name]), name
