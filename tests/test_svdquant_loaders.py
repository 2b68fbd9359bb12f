"""What the loaders of Nunchaku SVDQuant files read, recorded from their code as data, held against the headers
`port convert --quantize svdq-*` writes. No nunchaku build installs here (CUDA extension, GitHub wheels only), so
each loader's key set, shapes and metadata parsing are restated below from the named files and applied to the
written header; the model skeleton is the real diffusers class built from the file's `config`, as the loaders do.

Sources (read, not copied):
- nunchaku-tech/nunchaku @ 3a3cc3d `nunchaku/models/linear.py` (SVDQW4A4Linear, AWQW4A16Linear parameters),
  `nunchaku/models/transformers/utils.py` (`patch_scale_key`, `convert_flux_state_dict`), `nunchaku/utils.py`
  (`get_precision_from_quantization_config`); FLUX.1: `transformers/transformer_flux_v2.py`
  (NunchakuFluxTransformer2DModelV2: renames deepcompressor's names, then a strict load), `models/attention.py`,
  `models/normalization.py`. That snapshot has no FLUX.2 runtime; its C++ FLUX.1 loader (transformer_flux.py,
  which ComfyUI-nunchaku uses) takes deepcompressor's names into the C++ model and is not restated here.
- FLUX.2: tonera/nunchaku @ 0c8379d `nunchaku/models/transformers/transformer_flux2.py` (nunchux-ai/nunchaku PR
  #926, the runtime of the published `tonera/FLUX.2-klein-9B(-kv)-Nunchaku` files; the same tree and strict load in
  tom-m-2020/vitoom-nunchaku-extended). `from_pretrained` builds Flux2Transformer2DModel from `config`, swaps in
  the Nunchaku modules with the rank of `quantization_config`, fills missing `wcscales` with ones, pops `wtscale`,
  then `load_state_dict(strict=True)` with the file's keys as they are.
- ComfyUI: nunchaku-tech/ComfyUI-nunchaku @ dbfd194 `nodes/models/flux.py` and `nodes/models/configs/flux.1-*.json`
  (FLUX.1), and `nodes/models/flux2.py` + `wrappers/flux2.py` at 66832ec5 (FLUX.2, index only).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors import safe_open

from porting.tensors.quant.svdq.comfy import comfy_config

from .helpers import reference_model, save_state
from .reference.flux1_bfl import Flux1Params
from .reference.flux2_bfl import Flux2Params

TINY1 = Flux1Params(in_channels=16, vec_in_dim=24, context_dim=32, hidden=128, heads=1, depth=1, depth_single=1)
TINY2 = Flux2Params(in_channels=16, context_dim=48, hidden=128, heads=2, depth=1, depth_single=1,
                    axes=(16, 16, 16, 16))

Sizer = Callable[[Any], tuple[int, int, bool]]  # a diffusers block -> (in_features, out_features, bias)


def fused(*linears: str) -> Sizer:
    """A module replacing these diffusers linears, their rows fused (nunchaku `fuse_linears`: bias if all have one)."""
    def size(block: Any) -> tuple[int, int, bool]:
        mods = [block.get_submodule(name) for name in linears]
        return mods[0].in_features, sum(m.out_features for m in mods), all(m.bias is not None for m in mods)
    return size


def _same(module: str) -> tuple[str, Sizer, tuple[str, ...]]:
    return module, fused(module), (module,)


# Per family and block type: (W4A4 modules as (name, size, diffusers modules it replaces), AWQ W4A16 modules, diffusers
# modules the Nunchaku block drops). FLUX.2: tonera transformer_flux2.py (NunchakuFlux2Attention, -FeedForward,
# -ParallelSelfAttention, whose linears are new ones sized from the diffusers attention `a`); FLUX.1: nunchaku
# transformer_flux_v2.py (NunchakuFluxAttention, NunchakuFluxSingleTransformerBlock), attention.py
# (NunchakuFeedForward patches every nn.Linear of ff.net), normalization.py (AdaLayerNorm linears -> AWQW4A16Linear).
LOADER_BLOCKS: dict[str, dict[str, tuple[list[tuple[str, Sizer, tuple[str, ...]]], list[str], tuple[str, ...]]]] = {
    "flux2": {
        "transformer_blocks": ([
            ("attn.to_qkv", fused("attn.to_q", "attn.to_k", "attn.to_v"), ("attn.to_q", "attn.to_k", "attn.to_v")),
            ("attn.to_added_qkv", fused("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
             ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
            _same("attn.to_out.0"), _same("attn.to_add_out"), _same("ff.linear_in"), _same("ff.linear_out"),
            _same("ff_context.linear_in"), _same("ff_context.linear_out")], [], ()),
        "single_transformer_blocks": ([
            ("attn.qkv_proj", lambda b: (b.attn.query_dim, b.attn.inner_dim * 3, b.attn.use_bias), ()),
            ("attn.mlp_fc1", lambda b: (b.attn.query_dim, b.attn.mlp_hidden_dim * b.attn.mlp_mult_factor,
                                        b.attn.use_bias), ()),
            ("attn.out_proj", lambda b: (b.attn.inner_dim, b.attn.out_dim, b.attn.to_out.bias is not None), ()),
            ("attn.mlp_fc2", lambda b: (b.attn.mlp_hidden_dim, b.attn.out_dim, b.attn.to_out.bias is not None), ())],
            [], ("attn.to_qkv_mlp_proj", "attn.to_out")),
    },
    "flux1": {
        "transformer_blocks": ([
            ("attn.to_qkv", fused("attn.to_q", "attn.to_k", "attn.to_v"), ("attn.to_q", "attn.to_k", "attn.to_v")),
            ("attn.add_qkv_proj", fused("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
             ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")),
            _same("attn.to_out.0"), _same("attn.to_add_out"), _same("ff.net.0.proj"), _same("ff.net.2"),
            _same("ff_context.net.0.proj"), _same("ff_context.net.2")], ["norm1.linear", "norm1_context.linear"], ()),
        "single_transformer_blocks": ([
            ("attn.to_qkv", fused("attn.to_q", "attn.to_k", "attn.to_v"), ("attn.to_q", "attn.to_k", "attn.to_v")),
            ("mlp_fc1", fused("proj_mlp"), ()),
            ("mlp_fc2", lambda b: (b.mlp_hidden_dim, b.proj_out.out_features, b.proj_out.bias is not None), ()),
            ("attn.to_out", lambda b: (b.proj_mlp.in_features, b.proj_out.out_features, b.proj_out.bias is not None),
             ())], ["norm.linear"], ("proj_mlp", "proj_out")),
    },
}
DIFFUSERS_CLASS = {"flux1": "FluxTransformer2DModel", "flux2": "Flux2Transformer2DModel"}

# nunchaku transformers/utils.py convert_flux_state_dict (the FLUX.1 v2 loader renames deepcompressor's names; the
# first matching rule of a block type applies), then the part renames; FLUX.2 (tonera) loads keys as they are
FLUX1_RENAMES = {
    "single_transformer_blocks.": [(".qkv_proj.", ".attn.to_qkv."), (".out_proj.", ".attn.to_out."),
                                   (".norm_q.", ".attn.norm_q."), (".norm_k.", ".attn.norm_k.")],
    "transformer_blocks.": [(".mlp_context_fc1.", ".ff_context.net.0.proj."),
                            (".mlp_context_fc2.", ".ff_context.net.2."), (".mlp_fc1.", ".ff.net.0.proj."),
                            (".mlp_fc2.", ".ff.net.2."),
                            (".qkv_proj_context.", ".attn.add_qkv_proj."), (".qkv_proj.", ".attn.to_qkv."),
                            (".norm_q.", ".attn.norm_q."), (".norm_k.", ".attn.norm_k."),
                            (".norm_added_q.", ".attn.norm_added_q."), (".norm_added_k.", ".attn.norm_added_k."),
                            (".out_proj.", ".attn.to_out.0."), (".out_proj_context.", ".attn.to_add_out.")],
}
FLUX1_PARTS = [(".lora_down", ".proj_down"), (".lora_up", ".proj_up")]


def flux1_loader_key(key: str) -> str:
    for blocks, rules in FLUX1_RENAMES.items():
        if blocks in key:
            key = next((key.replace(old, new) for old, new in rules if old in key), key)
            for old, new in FLUX1_PARTS:
                key = key.replace(old, new)
            if ".smooth_orig" in key:
                return key.replace(".smooth_orig", ".smooth_factor_orig")
            return key.replace(".smooth", ".smooth_factor")
    return key


# nunchaku-tech/ComfyUI-nunchaku nodes/models/configs/flux.1-{dev,schnell,fill-dev}.json: model_class, and the
# model_config entries that differ from dev's
COMFY_FLUX1_DEV = {
    "axes_dim": [16, 56, 56], "context_in_dim": 4096, "depth": 19, "depth_single_blocks": 38,
    "disable_unet_model_creation": True, "guidance_embed": True, "hidden_size": 3072, "image_model": "flux",
    "in_channels": 16, "mlp_ratio": 4.0, "num_heads": 24, "out_channels": 16, "patch_size": 2, "qkv_bias": True,
    "theta": 10000, "vec_in_dim": 768,
}
COMFY_FLUX1 = {"dev": ("Flux", {}), "schnell": ("FluxSchnell", {"guidance_embed": False}),
               "fill-dev": ("Flux", {"in_channels": 96})}


Params = dict[str, tuple[tuple[int, ...], Any]]  # parameter name -> (shape, dtype)
CASES = ["flux2-int4", "flux2-nvfp4", "flux1-int4", "flux1-nvfp4"]


def svdq_params(k: int, n: int, rank: int, precision: str, bias: bool) -> Params:
    """SVDQW4A4Linear's parameters for in_features k, out_features n (nunchaku models/linear.py)."""
    group = 16 if precision == "nvfp4" else 64
    out = {"qweight": ((n, k // 2), torch.int8),
           "wscales": ((k // group, n), torch.float8_e4m3fn if precision == "nvfp4" else torch.bfloat16),
           "smooth_factor": ((k,), torch.bfloat16), "smooth_factor_orig": ((k,), torch.bfloat16),
           "proj_down": ((k, rank), torch.bfloat16), "proj_up": ((n, rank), torch.bfloat16)}
    if bias:
        out["bias"] = ((n,), torch.bfloat16)
    if precision == "nvfp4":
        out["wcscales"] = ((n,), torch.bfloat16)
    return out


def awq_params(k: int, n: int) -> Params:
    """AWQW4A16Linear's parameters, group 64 (nunchaku models/linear.py)."""
    return {"qweight": ((n // 4, k // 2), torch.int32), "bias": ((n,), torch.bfloat16),
            "wscales": ((k // 64, n), torch.bfloat16), "wzeros": ((k // 64, n), torch.bfloat16)}


def precision_of(quantization_config: dict) -> str:
    """nunchaku utils.py get_precision_from_quantization_config."""
    weight = quantization_config["weight"]
    if weight["dtype"] == "fp4_e2m1_all" and weight["group_size"] == 16:
        return "nvfp4"
    if weight["dtype"] == "int4":
        return "int4"
    raise ValueError(f"nunchaku refuses weight {weight}")


def loader_state(family: str, meta: dict[str, str]) -> tuple[Params, set[str], str]:
    """The state dict the loader's model holds after `_patch_model` for this header's `config` and
    `quantization_config`, the names of its W4A4 modules, and the precision."""
    import diffusers

    from porting.skeleton import diffusers_skeleton

    q = json.loads(meta["quantization_config"])
    precision, rank = precision_of(q), int(q.get("rank", 32))
    model = diffusers_skeleton(getattr(diffusers, DIFFUSERS_CLASS[family]), json.loads(meta["config"]))
    state = {k: (tuple(v.shape), torch.bfloat16 if v.is_floating_point() else v.dtype)
             for k, v in model.state_dict().items()}
    modules: set[str] = set()

    def drop(prefix: str) -> None:
        for key in [key for key in state if key.startswith(prefix + ".")]:
            del state[key]

    for blocks, (w4a4, awq, dropped) in LOADER_BLOCKS[family].items():
        for i, block in enumerate(getattr(model, blocks)):
            base = f"{blocks}.{i}."
            sizes = [(name, size(block), replaced) for name, size, replaced in w4a4]
            awq_sizes = [(name, block.get_submodule(name)) for name in awq]
            for name in dropped:
                drop(base + name)
            for name, (k, n, bias), replaced in sizes:
                for old in replaced:
                    drop(base + old)
                modules.add(base + name)
                state.update({f"{base}{name}.{p}": v for p, v in svdq_params(k, n, rank, precision, bias).items()})
            for name, linear in awq_sizes:
                drop(base + name)
                state.update({f"{base}{name}.{p}": v for p, v in awq_params(linear.in_features,
                                                                             linear.out_features).items()})
    return state, modules, precision


def strict_load_problems(family: str, meta: dict[str, str], header: Params) -> list[str]:
    """What from_pretrained would fail on: the key renames (FLUX.1), patch_scale_key (a key the file lacks must be a
    `wcscales`, filled with ones; `<module>.wtscale` is popped), then load_state_dict(strict=True): missing and
    unexpected keys, shape mismatches (dtypes are cast by copy_; compared here all the same)."""
    state, modules, precision = loader_state(family, meta)
    given = {flux1_loader_key(k) if family == "flux1" else k: v for k, v in header.items()}
    problems = [f"missing {k}" for k in state if k not in given and not k.endswith(".wcscales")]
    if precision == "nvfp4":
        for module in modules:
            given.pop(f"{module}.wtscale", None)
    problems += [f"unexpected {k}" for k in given if k not in state]
    problems += [f"{k}: file {given[k]} vs model {state[k]}" for k in given if k in state and given[k] != state[k]]
    return problems


def _header(path: Path) -> tuple[Params, dict[str, str]]:
    with safe_open(str(path), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_tensor(k).dtype) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, Path]:
    """Tiny klein and FLUX.1 files in both precisions through the CLI; klein int4 at rank 20 (stored padded to 32)."""
    root = tmp_path_factory.mktemp("svdq-loaders")
    sources = {"flux2": save_state(root / "klein-tiny.safetensors", reference_model(TINY2, seed=4).state_dict(),
                                   torch.bfloat16),
               "flux1": save_state(root / "flux1-tiny.safetensors", reference_model(TINY1, seed=3).state_dict(),
                                   torch.bfloat16)}
    out = {}
    for name in CASES:
        family, precision = name.split("-")
        more = ["--rank", "20"] if name == "flux2-int4" else []
        code, stdout = _convert(sources[family], root / name, f"svdq-{precision}", *more)
        assert code == 0, stdout
        out[name] = root / name / json.loads(stdout)["file"]
    return out


def _convert(src: Path, out: Path, quantize: str, *more: str) -> tuple[int, str]:
    import contextlib
    import io

    from porting.cli.app import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):  # a module-scoped fixture has no capsys
        try:
            main(["convert", str(src), "--quantize", quantize, *more, "--out", str(out), "--json"])
        except SystemExit as e:
            return int(e.code or 0), buf.getvalue()
    return 0, buf.getvalue()


@pytest.mark.parametrize("name", CASES)
def test_written_file_strict_loads_in_the_runtime(written, name):
    """klein: tonera's NunchakuFlux2Transformer2DModel; FLUX.1: nunchaku's NunchakuFluxTransformer2DModelV2."""
    family = name.split("-")[0]
    header, meta = _header(written[name])
    assert strict_load_problems(family, meta, header) == []
    q = json.loads(meta["quantization_config"])
    down = {"flux2": "transformer_blocks.0.attn.to_qkv.proj_down", "flux1": "transformer_blocks.0.qkv_proj.lora_down"}
    down = down[family]
    assert q["rank"] == header[down][0][1] == 32  # the loaders size the branch from quantization_config.rank
    assert json.loads(meta["flux_port"])["rank_asked"] == (20 if name == "flux2-int4" else 32)


def test_the_load_check_fails_on_what_the_runtimes_refuse(written):
    """The emulated load is not vacuous: each of these headers is one the runtime would refuse."""
    header, meta = _header(written["flux2-int4"])
    asked = dict(meta, quantization_config=json.dumps({**json.loads(meta["quantization_config"]), "rank": 20}))
    assert any("proj_down" in p for p in strict_load_problems("flux2", asked, header))  # not the stored rank
    legacy = {k.replace("attn.to_qkv.", "qkv_proj."): v for k, v in header.items()}  # deepcompressor's names
    assert any(p.startswith("unexpected transformer_blocks.0.qkv_proj.")
               for p in strict_load_problems("flux2", meta, legacy))
    rows = header["transformer_blocks.0.ff.linear_in.qweight"][0][0]
    biased = dict(header, **{"transformer_blocks.0.ff.linear_in.bias": ((rows,), torch.bfloat16)})
    assert strict_load_problems("flux2", meta, biased) == ["unexpected transformer_blocks.0.ff.linear_in.bias"]
    nv_header, nv_meta = _header(written["flux2-nvfp4"])
    nv_header.pop("transformer_blocks.0.attn.to_out.0.wscales")
    assert strict_load_problems("flux2", nv_meta, nv_header) == ["missing transformer_blocks.0.attn.to_out.0.wscales"]
    f1_header, f1_meta = _header(written["flux1-int4"])
    f1_header.pop("single_transformer_blocks.0.mlp_fc2.bias")  # FLUX.1 linears have biases: the loader wants them
    assert strict_load_problems("flux1", f1_meta, f1_header) == ["missing single_transformer_blocks.0.mlp_fc2.bias"]
    module_parts = {k.replace(".smooth", ".smooth_factor"): v for k, v in f1_header.items()}  # renamed twice
    assert any(p.startswith("unexpected ") and p.endswith(".smooth_factor_factor")
               for p in strict_load_problems("flux1", f1_meta, module_parts))


def test_comfy_config_flux1_is_comfyui_nunchakus():
    """The FLUX.1 entry for the released configs equals ComfyUI-nunchaku's bundled JSON for that model."""
    from porting.families.flux1 import Flux1

    dev = Flux1.real_configs["FLUX.1-dev"]
    configs = {"dev": dev, "schnell": {**dev, "guidance_embeds": False},
               "fill-dev": {**dev, "in_channels": 384, "out_channels": 64}}
    for name, (model_class, changes) in COMFY_FLUX1.items():
        assert comfy_config("flux1", configs[name]) == {"model_class": model_class,
                                                        "model_config": {**COMFY_FLUX1_DEV, **changes}}, name


@pytest.mark.parametrize("name", ["flux1-int4", "flux2-nvfp4"])
def test_header_carries_comfy_config_as_the_loaders_parse_it(written, name):
    """NunchakuFluxDiTLoader json-parses metadata["comfy_config"] (no fallback for a single file), asserts
    model_class is Flux / FluxSchnell, and its wrapper reads guidance_embed and patch_size (default 2).
    NunchakuFlux2DiTLoader prefers the entry over its own build from `config`; ComfyUI's Flux2 reads hidden_size."""
    _, meta = _header(written[name])
    config = json.loads(meta["config"])
    parsed = json.loads(meta["comfy_config"])
    model = parsed["model_config"]
    assert model["disable_unet_model_creation"] is True
    assert model["guidance_embed"] == bool(config.get("guidance_embeds"))
    assert model["hidden_size"] == config["num_attention_heads"] * config["attention_head_dim"]
    if name.startswith("flux1"):
        assert parsed["model_class"] in ("Flux", "FluxSchnell") and model["image_model"] == "flux"
        assert model["patch_size"] == 2 and model["in_channels"] * 4 == config["in_channels"]
        assert model["depth"] == config["num_layers"] and model["vec_in_dim"] == config["pooled_projection_dim"]
    else:
        # the loader's fallback (flux2.py _build_comfy_config_from_metadata) from the same config, out_channels aside
        fallback = {"image_model": "flux2", "guidance_embed": config.get("guidance_embeds", True),
                    "hidden_size": config.get("attention_head_dim", 128) * config.get("num_attention_heads", 16),
                    "in_channels": config.get("in_channels", 64), "patch_size": config.get("patch_size", 2),
                    "disable_unet_model_creation": True}
        assert parsed["model_class"] == "Flux2"
        assert {k: v for k, v in model.items() if k != "out_channels"} == fallback
        assert model["out_channels"] == (config.get("out_channels") or config["in_channels"])
