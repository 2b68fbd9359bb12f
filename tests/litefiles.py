"""Tiny folders in diffusers' own Nunchaku layout ("Nunchaku Lite"), packed by deepcompressor's converter.

Independent of flux-port's code: every diffusers linear of the blocks is one layer, its converter inputs made here
(`svdqfiles._quantize` / `_lowrank`, the oracle's rounding) and packed by deepcompressor's per-layer converters
(`convert_to_nunchaku_w4x4y16_linear_state_dict`; AWQ `convert_to_nunchaku_w4x16_linear_weight` with no adaLN split,
which is how diffusers' `AWQW4A16Linear` runs a plain linear). The parts are then renamed to diffusers' module
parameter names (`smooth` -> `smooth_factor`, `lora_down` -> `proj_down`, `lora_up` -> `proj_up`, no
`smooth_orig`), nvfp4 layers get both `wcscales` (ones) and `wtscale`, FLUX.2's zero biases are left out (its linears
have none), and config.json gets the `quantization_config` diffusers' `NunchakuLiteQuantizationConfig` reads.
`check_with_diffusers` (a child interpreter) holds a folder to diffusers' own `replace_with_nunchaku_linear` and
`check_strict_state_dict_match`, and to the shapes and dtypes the replaced model declares.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from .svdqfiles import (
    BF16,
    F64,
    _full_config,
    _lowrank,
    _model_class,
    _one_thread,
    _quantize,
    _quiet,
    _random_state,
    _save,
)

AWQ_TARGETS = {"flux1": ("norm1.linear", "norm1_context.linear", "norm.linear"),
               "flux2": ("double_stream_modulation_img.linear", "double_stream_modulation_txt.linear",
                         "single_stream_modulation.linear")}


@dataclass
class LiteFixture:
    path: Path  # the transformer folder
    family: str
    precision: str
    rank: int
    config: dict  # config.json, with quantization_config
    expected: dict[str, torch.Tensor]  # diffusers-named float32 tensors the kernels compute with
    tensors: dict[str, torch.Tensor]  # what the safetensors file holds


def _linears(family: str, config: dict) -> list[tuple[str, int, int, bool]]:
    """(module name, out, in, has bias) of every linear of the model, in its order."""
    from porting.skeleton import diffusers_skeleton

    model = diffusers_skeleton(_model_class(family), config)
    return [(name, m.out_features, m.in_features, m.bias is not None) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)]


def _svdq_layer(w: torch.Tensor, b: torch.Tensor | None, precision: str, rank: int, gen: torch.Generator
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from deepcompressor.backend.nunchaku.convert import convert_to_nunchaku_w4x4y16_linear_state_dict

    w = w.to(F64)
    n, k = w.shape
    s = (0.5 + torch.rand(k, generator=gen, dtype=F64)).to(BF16)
    ws = w * s.to(F64)
    up, down = _lowrank(ws, rank)
    q = _quantize(ws - up.to(F64) @ down.to(F64), precision)
    sd = _quiet(convert_to_nunchaku_w4x4y16_linear_state_dict, weight=q["weight"], scale=q["scale"],
                bias=None if b is None else b.to(BF16), smooth=s, lora=(down, up), float_point=precision == "nvfp4",
                subscale=q["subscale"])
    d_file = (down.to(F64) / s.to(F64)).to(BF16)
    expected = q["deq"] / s.to(F64) + up.to(F64) @ d_file.to(F64)
    parts = {"qweight": sd["qweight"], "wscales": sd["wscales"], "smooth_factor": sd["smooth"],
             "proj_down": sd["lora_down"], "proj_up": sd["lora_up"]}
    if precision == "nvfp4":
        parts["wtscale"] = sd.get("wtscale", torch.ones(1, dtype=BF16)).reshape(1)
        parts["wcscales"] = sd.get("wcscales", torch.ones(n, dtype=BF16))
    if b is not None:
        parts["bias"] = sd["bias"]
    return parts, expected


def _awq_layer(w: torch.Tensor, b: torch.Tensor | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    from deepcompressor.backend.nunchaku.utils import convert_to_nunchaku_w4x16_linear_weight

    w = w.to(F64)
    n, k = w.shape
    g = w.view(n, k // 64, 64)
    scale = (g.abs().amax(-1) / 7).clamp_min(2.0**-24).to(BF16)
    c = torch.round(g / scale.to(F64).unsqueeze(-1)).clamp(-7, 7)
    w_in = (c * scale.to(F64).unsqueeze(-1)).view(n, k).to(BF16)
    qweight, wscales, wzeros, bias = _quiet(convert_to_nunchaku_w4x16_linear_weight, w_in,
                                            scale=scale.view(n, 1, k // 64, 1),
                                            bias=None if b is None else b.to(BF16).clone(), adanorm_splits=1)
    # the converter's rounding (zero 7 pre-scaled): q = round((w + 7 s) / s) in float32, wzeros = -bf16(7 s)
    s32 = scale.to(torch.float32).unsqueeze(-1)
    q = ((w_in.to(torch.float32).view(n, k // 64, 64) + 7 * s32) / s32).round_()
    expected = (q.to(F64) * scale.to(F64).unsqueeze(-1) - (7 * s32).to(BF16).to(F64)).view(n, k)
    groups = k // 64  # the converter pads the groups to a multiple of 16; diffusers declares (in / 64, out)
    parts = {"qweight": qweight, "wscales": wscales[:groups].contiguous(), "wzeros": wzeros[:groups].contiguous()}
    if b is not None:
        parts["bias"] = bias
    return parts, expected


def lite_config(family: str, precision: str, rank: int, svdq: list[str], awq: list[str]) -> dict:
    out: dict = {"quant_method": "nunchaku_lite", "compute_dtype": "bfloat16",
                 "svdq_w4a4": {"precision": precision, "group_size": 64 if precision == "int4" else 16,
                               "rank": rank, "targets": svdq}}
    if awq:
        out["awq_w4a16"] = {"precision": "int4", "group_size": 64, "targets": awq}
    return out


def write_lite_folder(out_dir: Path, family: str = "flux2", precision: str = "int4", *, rank: int = 16,
                      seed: int = 0, awq: bool = True) -> LiteFixture:
    """A tiny transformer folder in diffusers' Nunchaku layout: every linear of the blocks SVDQuant W4A4, and (with
    `awq`) the FLUX.1 adaLN / FLUX.2 modulation linears AWQ W4A16."""
    config = _full_config(family)
    awq_names = AWQ_TARGETS[family] if awq else ()
    gen = torch.Generator().manual_seed(seed + 7)
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    svdq_targets, awq_targets = [], []
    with _one_thread():
        original = _random_state(family, config, seed)
        for name, _, _, bias in _linears(family, config):
            w, b = original[f"{name}.weight"], original.get(f"{name}.bias") if bias else None
            is_awq = any(name == a or name.endswith("." + a) for a in awq_names)
            if not is_awq and not name.startswith(("transformer_blocks.", "single_transformer_blocks.")):
                continue
            if is_awq:
                parts, w_eff = _awq_layer(w, b)
                awq_targets.append(name)
            else:
                parts, w_eff = _svdq_layer(w, b, precision, rank, gen)
                svdq_targets.append(name)
            tensors.update({f"{name}.{p}": t.contiguous() for p, t in parts.items()})
            expected[f"{name}.weight"] = w_eff.to(torch.float32)
            if b is not None:
                expected[f"{name}.bias"] = b.to(BF16).to(torch.float32)
        for key, value in original.items():
            module = key.rpartition(".")[0]
            if module not in svdq_targets and module not in awq_targets:
                tensors[key] = value.to(BF16)
                expected[key] = value.to(BF16).to(torch.float32)
    config = {**config, "quantization_config": lite_config(family, precision, rank, svdq_targets, awq_targets)}
    folder = Path(out_dir) / f"lite-{family}-{precision}"
    _save(folder / "diffusion_pytorch_model.safetensors", tensors, None)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return LiteFixture(folder, family, precision, rank, config, expected, tensors)


# ----------------------------------------------------------------------------------------------------------------
# diffusers' own judgement, in a child interpreter: `diffusers.quantizers.nunchaku.utils` imports the `kernels`
# package at import time (to fetch the CUDA kernels from the Hub) and refuses unless DIFFUSERS_TRUST_REMOTE_KERNELS
# is set, both read once when diffusers is first imported. The child gets a stub `kernels` distribution whose
# get_kernel returns nothing callable: only the kernel import is stubbed; the replacement and the key matching are
# diffusers' own, and nothing that would run a kernel is called.

_STUB = '''
class _NoKernels:
    def __getattr__(self, name):
        raise RuntimeError("stub kernels: " + name + " was called; the check runs no kernel")


class _Kernel:
    ops = _NoKernels()


def get_kernel(*args, **kwargs):
    return _Kernel()
'''

_CHECK = textwrap.dedent('''
    import json, sys
    import torch
    import diffusers
    from safetensors.torch import load_file
    from diffusers.quantizers.nunchaku.utils import check_strict_state_dict_match, replace_with_nunchaku_linear
    from diffusers.quantizers.quantization_config import NunchakuLiteQuantizationConfig

    report = {}
    for folder in sys.argv[1:]:
        config = json.load(open(folder + "/config.json"))
        qc = NunchakuLiteQuantizationConfig.from_dict(dict(config["quantization_config"])).to_dict()
        cls = getattr(diffusers, config["_class_name"])
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        with torch.device("meta"):
            model = cls.from_config(plain)
        replaced = replace_with_nunchaku_linear(model, qc, getattr(torch, qc.get("compute_dtype", "bfloat16")))
        state = load_file(folder + "/diffusion_pytorch_model.safetensors")
        errors = []
        try:
            check_strict_state_dict_match(model, state)
        except ValueError as e:
            errors.append(str(e))
        declared = dict(model.named_parameters())
        declared.update(dict(model.named_buffers()))
        targets = [t + "." for op in ("svdq_w4a4", "awq_w4a16") for t in (qc.get(op) or {}).get("targets", [])]
        for key, t in state.items():
            want = declared.get(key)
            if want is None:
                continue
            # the replaced modules declare their dtypes; the 16-bit rest is cast to the load dtype by from_pretrained
            packed = any(key.startswith(p) for p in targets)
            if tuple(want.shape) != tuple(t.shape) or (packed and want.dtype != t.dtype):
                errors.append(f"{key}: stored {t.dtype} {list(t.shape)}, declared {want.dtype} {list(want.shape)}")
        report[folder] = {"replaced": replaced, "errors": errors}
    print(json.dumps(report))
''')


def check_with_diffusers(folders: list[Path], tmp: Path) -> dict[str, dict]:
    """diffusers' verdict on each folder: {folder: {"replaced": targets replaced, "errors": [...]}}."""
    stub = tmp / "kernels-stub"
    (stub / "kernels").mkdir(parents=True, exist_ok=True)
    (stub / "kernels" / "__init__.py").write_text(_STUB)
    info = stub / "kernels-0.14.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.14.0\n")
    (info / "top_level.txt").write_text("kernels\n")
    (info / "RECORD").write_text("kernels/__init__.py,,\n")
    env = {**os.environ, "DIFFUSERS_TRUST_REMOTE_KERNELS": "1",
           "PYTHONPATH": os.pathsep.join([str(stub), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _CHECK, *map(str, folders)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
