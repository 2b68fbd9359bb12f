"""The packed linears' fast path (`tiles.*_band_values`, `PackedPiece.product`, w4a16 as (x/s)·Rᵀ + (x·Dᵀ)·Uᵀ)
against the reference decoder (`tiles.decode_values` lookups, `decode.SvdqDecoder`): the same 4-bit values bit for
bit, and the same outputs in both compute modes, for int4 and nvfp4, FLUX.1 (AWQ adaLN, GELU-shifted down
projections) and FLUX.2, with a rank the file pads to 16, 6 or 24 groups per row, and ragged bands."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

pytest.importorskip("deepcompressor.backend.nunchaku.convert",
                    reason="the oracle: pip install --no-deps deepcompressor-toolkit==0.1.0 (as .ci/run does)")

from porting.inputs import as_source  # noqa: E402
from porting.runtime import svdq_linear  # noqa: E402
from porting.runtime.svdq_act import SHIFT_GELU, int4_activations, nvfp4_activations, smoothed  # noqa: E402
from porting.runtime.svdq_linear import SvdqLinear  # noqa: E402
from porting.runtime.svdq_model import load_svdq_transformer, svdq_info  # noqa: E402
from porting.tensors.quant.svdq import tiles as P  # noqa: E402
from porting.tensors.quant.svdq.decode import SvdqDecoder  # noqa: E402
from porting.tensors.quant.svdq.header import Piece, SvdqLayer, Target  # noqa: E402
from porting.tensors.reader import read_stored  # noqa: E402

from .svdqfiles import write_svdq_file  # noqa: E402

CASES = [("flux2", "int4"), ("flux2", "nvfp4"), ("flux1", "int4"), ("flux1", "nvfp4")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("flush_denormal", [False, True])
def test_band_values_equal_the_byte_lookup_for_every_byte(flush_denormal):
    """All 256 bytes, random scales: int4 by arithmetic shifts, nvfp4 by float16 bit placement (its 0.5 is a float16
    subnormal, so also with denormals flushed), AWQ unsigned; each equal to the reference lookup, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randperm(256, generator=gen).to(torch.uint8).repeat(3, 2)  # (3, 512): k = 1024
    int4_scales = torch.rand(3, 16, generator=gen).bfloat16()
    micro = (torch.rand(3, 64, generator=gen) * 8).to(torch.float8_e4m3fn)
    zeros = -torch.rand(3, 16, generator=gen).bfloat16()
    old = torch.is_flush_denormal_enabled() if hasattr(torch, "is_flush_denormal_enabled") else False
    torch.set_flush_denormal(flush_denormal)
    try:
        int4 = P.int4_band_values(codes, int4_scales)
        fp4 = P.nvfp4_band_values(codes, micro)
        awq = P.awq_band_values(codes, int4_scales, zeros)
    finally:
        torch.set_flush_denormal(old)
    for precision, got, scales, group in (("int4", int4, int4_scales, 64), ("nvfp4", fp4, micro, 16)):
        want = P.byte_values(precision).index_select(0, codes.reshape(-1).int()).reshape(3, 1024)
        want = (want.view(3, -1, group) * scales.float()[:, :, None]).view(3, 1024)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), precision
    unsigned = P.nibbles(codes).reshape(3, 1024).float()
    want = unsigned * int4_scales.float().repeat_interleave(64, 1) + zeros.float().repeat_interleave(64, 1)
    assert torch.equal(awq, want)


def _reference_values(layer: SvdqLayer, decoder: SvdqDecoder, rows: tuple[int, int]) -> torch.Tensor:
    """Rows of a layer's code·scale values from the stored file by the reference path (MMA tiles undone by
    `decode_values`' byte lookup, scales unpacked by `UnpackedLayer`); AWQ: the decoder's whole weight."""
    a, b = rows
    u = decoder.unpacked(layer)
    if layer.kind == "awq":
        return u.whole[a:b]
    values = P.decode_values(read_stored(layer.parts["qweight"]), layer.n, layer.k, layer.precision)[a:b]
    return (values.view(b - a, -1, u.group) * u.scales[a:b, :, None]).view(b - a, layer.k)


def _reference_w4a4(piece: Piece, with_bias: bool, decoder: SvdqDecoder, x: torch.Tensor) -> torch.Tensor:
    """The kernel's equations in float32 (every T rounding the identity), from the reference decode's parts."""
    layer, (a, b) = piece.layer, piece.rows
    u = decoder.unpacked(layer)
    if layer.kind == "awq":
        return x @ u.whole[a:b].t() + u.bias[a:b]
    h = smoothed(x, u.smooth, SHIFT_GELU if layer.gelu_shift else 0.0, torch.float32)
    act = nvfp4_activations(h) if layer.precision == "nvfp4" else int4_activations(h, torch.float32,
                                                                                   layer.gelu_shift)
    y = act @ _reference_values(layer, decoder, (a, b)).t()
    if u.row_scale is not None:
        y = y * u.row_scale[a:b]
    if with_bias:
        y = y + u.file_bias[a:b]
    if u.up is not None:
        y = y + (x @ u.down.t()) @ u.up[a:b].t()
    return y


def _joined(target: Target, x: torch.Tensor, each: Callable[[Piece, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if target.join == "columns":
        outs, start = [], 0
        for p in target.pieces:
            outs.append(each(p, x[:, start:start + p.layer.k]))
            start += p.layer.k
        return torch.stack(outs).sum(dim=0)
    return torch.cat([each(p, x) for p in target.pieces], dim=-1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_fast_path_equals_the_reference_decode(case, tmp_path, monkeypatch):
    family, precision = case
    fx = write_svdq_file(tmp_path / "src", family, precision, rank=5)  # the converter pads the rank to 16
    monkeypatch.setattr(svdq_linear, "BAND_ELEMENTS", 40 * 384)  # several bands per layer, the last one ragged
    model = load_svdq_transformer(fx.path, torch.float32, "w4a16")
    info = svdq_info(as_source(fx.path, kind="weights").view)
    decoder = SvdqDecoder(info)
    gen = torch.Generator().manual_seed(1)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, SvdqLinear)]
    kinds = {p.kind for _, m in linears for p in m.pieces}
    assert kinds == ({"w4a4", "awq"} if family == "flux1" else {"w4a4"}), kinds
    assert any(len(p.bands()) > 2 and (p.bands()[-1][1] - p.bands()[-1][0]) != p.bands()[0][1] - p.bands()[0][0]
               for _, m in linears for p in m.pieces)
    for name, m in linears:
        target = info.targets[name + ".weight"]
        for piece, stored in zip(m.pieces, target.pieces, strict=True):
            values = piece.values(0, piece.n)
            assert torch.equal(values, _reference_values(stored.layer, decoder, stored.rows)), name
            assert torch.equal(piece.values(0, piece.n, torch.bfloat16), values.bfloat16()), name  # made in bf16
        x = torch.randn(7, m.in_features, generator=gen)
        want = x @ decoder.dequantize(name + ".weight").t()
        if name + ".bias" in info.targets:
            want = want + decoder.dequantize(name + ".bias")
        m.compute = "w4a16"
        with torch.no_grad():
            assert _rel(m(x), want) < 1e-5, (name, _rel(m(x), want))
            assert _rel(m(x.bfloat16()), want) < 1e-2, name  # a bf16 run: bf16 rounding of x/s, R and the output
            m.compute = "w4a4"
            with_bias = name + ".bias" in info.targets
            kernel = _joined(target, x, lambda p, xs: _reference_w4a4(p, with_bias, decoder, xs))
            assert _rel(m(x), kernel) < 1e-5, (name, _rel(m(x), kernel))
