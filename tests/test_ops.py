"""Tensor operations (each with its inverse) and mapping-table validation at load time."""

from __future__ import annotations

import pytest
import torch

from porting.errors import MappingTableError
from porting.families import builtin_tables, get_family
from porting.families.mapping import load_table_file
from porting.families.ops import Cast, Concat, OpShapeError, Rename, Split, SwapHalves

# --- hand-built expectations ---------------------------------------------------------------------------------------


def test_split_equal_parts_hand_built():
    fused = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0), torch.full((2, 3), 3.0)])
    q, k, v = Split(dim=0, parts=3).apply([fused])
    for part, value in zip((q, k, v), (1.0, 2.0, 3.0)):
        torch.testing.assert_close(part, torch.full((2, 3), value), rtol=0, atol=0)


def test_split_sized_parts_along_columns_hand_built():
    """FLUX.1 linear1 style: unequal sizes [q, k, v, mlp], here along dim 1."""
    fused = torch.cat([torch.full((2, s), float(i)) for i, s in enumerate((2, 2, 2, 5))], dim=1)
    parts = Split(dim=1, parts=4, sizes=(2, 2, 2, 5)).apply([fused])
    assert [tuple(p.shape) for p in parts] == [(2, 2), (2, 2), (2, 2), (2, 5)]
    for i, p in enumerate(parts):
        assert torch.equal(p, torch.full_like(p, float(i)))


def test_swap_halves_hand_built():
    shift, scale = torch.full((3, 2), 1.0), torch.full((3, 2), 2.0)
    (swapped,) = SwapHalves(dim=0).apply([torch.cat([shift, scale])])
    assert torch.equal(swapped, torch.cat([scale, shift]))


def test_concat_hand_built():
    (joined,) = Concat(dim=0, parts=2).apply([torch.zeros(1, 2), torch.ones(2, 2)])
    assert torch.equal(joined, torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))


# --- every op: inverse round trip and shape prediction -------------------------------------------------------------

OPS = {
    "rename": (Rename(), [(6, 4)]),
    "split equal dim0": (Split(0, 3), [(6, 4)]),
    "split sized dim0": (Split(0, 3, (1, 2, 3)), [(6, 4)]),
    "split equal dim1": (Split(1, 2), [(3, 8)]),
    "split 1-d": (Split(0, 2), [(10,)]),
    "concat equal dim0": (Concat(0, 3), [(2, 4), (2, 4), (2, 4)]),
    "concat sized dim0": (Concat(0, 3, (2, 3, 1)), [(2, 4), (3, 4), (1, 4)]),
    "concat sized dim1": (Concat(1, 2, (3, 5)), [(2, 3), (2, 5)]),
    "swap halves dim0": (SwapHalves(0), [(8, 3)]),
    "swap halves dim1": (SwapHalves(1), [(3, 8)]),
    "swap halves 1-d (a bias)": (SwapHalves(0), [(6,)]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPS))
def test_op_inverse_round_trips_and_shapes_are_predicted(name, dtype):
    op, in_shapes = OPS[name]
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(s, generator=gen).to(dtype) for s in in_shapes]
    outputs = op.apply(inputs)
    assert len(outputs) == op.n_out()
    assert [tuple(t.shape) for t in outputs] == op.shapes([tuple(s) for s in in_shapes])
    inverse = op.inverse()
    assert inverse.shapes([tuple(t.shape) for t in outputs]) == [tuple(s) for s in in_shapes]
    back = inverse.apply([t.contiguous() for t in outputs])
    assert len(back) == len(inputs)
    for a, b in zip(back, inputs):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert inverse.inverse() == op  # an inverse's inverse is the operation itself


@pytest.mark.parametrize("op, shapes, message", [
    (Split(0, 3), [(7, 2)], "cannot split 7 rows into 3 equal parts"),
    (Split(0, 2, (3, 3)), [(7, 2)], "split sizes [3, 3] sum to 6, tensor has 7 along dim 0"),
    (Split(2, 2), [(4, 4)], "split along dim 2 of a 2-d tensor"),
    (SwapHalves(0), [(5, 2)], "cannot swap halves of shape [5, 2] along dim 0"),
    (Concat(0, 2), [(2, 3), (2, 4)], "cannot concatenate shapes [[2, 3], [2, 4]] along dim 0"),
    (Concat(0, 2, (2, 2)), [(2, 3), (1, 3)], "parts have sizes [2, 1] along dim 0, the table expects [2, 2]"),
    # without sizes the inverse would split equally, so unequal parts are refused
    (Concat(0, 2), [(2, 3), (1, 3)], "parts have unequal sizes [2, 1] along dim 0; a concat of unequal parts needs"),
])
def test_shape_errors_are_reported_before_any_data(op, shapes, message):
    with pytest.raises(OpShapeError) as e:
        op.shapes(shapes)
    assert message in str(e.value)


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16])
def test_widening_cast_round_trips_exactly(source):
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1)).to(source)
    cast = Cast(torch.float32, source)
    (wide,) = cast.apply([x])
    assert wide.dtype == torch.float32 and cast.shapes([(4, 5)]) == [(4, 5)]
    (back,) = cast.inverse().apply([wide])
    assert back.dtype == source and torch.equal(back, x)


def test_cast_inverse_needs_the_source_dtype():
    with pytest.raises(ValueError, match="needs the source dtype"):
        Cast(torch.float32).inverse()


# --- mapping tables ------------------------------------------------------------------------------------------------

HEAD = """
format_version = 1

[table]
name = "toy"
diffusers_class = "Flux2Transformer2DModel"
blocks = { d = "num_layers" }
[detect]
original = ["a.weight"]
diffusers = ["b.weight"]
[infer.original]
inner_dim = ["a.weight", 0]
[infer.diffusers]
inner_dim = ["b.weight", 0]
"""


def load(tmp_path, rules: str):
    path = tmp_path / "toy.toml"
    path.write_text(HEAD + rules)
    return load_table_file(path)


def test_a_valid_toy_table_expands_both_ways(tmp_path):
    table = load(tmp_path, """
[[rule]]
original = "blocks.{d}.qkv.weight"
diffusers = ["b.{d}.q.weight", "b.{d}.k.weight", "b.{d}.v.weight"]
op = { name = "split", dim = 0, sizes = ["inner_dim", "inner_dim", "inner_dim"] }
""")
    forward = table.expand({"num_layers": 2, "inner_dim": 4}, "original")
    assert [s.sources for s in forward] == [("blocks.0.qkv.weight",), ("blocks.1.qkv.weight",)]
    assert forward[0].targets == ("b.0.q.weight", "b.0.k.weight", "b.0.v.weight")
    assert forward[0].op == Split(0, 3, (4, 4, 4))
    backward = table.expand({"num_layers": 2, "inner_dim": 4}, "diffusers")
    assert backward[1].sources == forward[1].targets and backward[1].targets == forward[1].sources
    assert backward[1].op == Concat(0, 3, (4, 4, 4))


@pytest.mark.parametrize("rules, message", [
    # bad arity: several keys need an op
    ('[[rule]]\noriginal = "x.weight"\ndiffusers = ["y.weight", "z.weight"]\n',
     "rule 1: 1 -> 2 keys needs an `op` (split or concat)"),
    # bad arity: a split takes one key
    ('[[rule]]\noriginal = ["x.weight", "w.weight"]\ndiffusers = ["y.weight", "z.weight"]\n'
     'op = { name = "split", dim = 0 }\n', "operation split takes 1 -> 2 keys, rule lists 2 -> 2"),
    # bad arity: a swap is one key to one key
    ('[[rule]]\noriginal = "x.weight"\ndiffusers = ["y.weight", "z.weight"]\nop = { name = "swap_halves" }\n',
     "operation swap_halves takes 1 -> 1 keys, rule lists 1 -> 2"),
    # sizes list of the wrong length
    ('[[rule]]\noriginal = "x.weight"\ndiffusers = ["y.weight", "z.weight"]\n'
     'op = { name = "split", dim = 0, sizes = [1, 2, 3] }\n', "split lists 3 sizes for 2 parts"),
    ('[[rule]]\noriginal = "x.weight"\ndiffusers = "y.weight"\nop = { name = "transpose" }\n',
     "unknown operation 'transpose' (known: rename, split, concat, swap_halves)"),
    ('[[rule]]\noriginal = "blocks.{n}.x.weight"\ndiffusers = "b.{n}.y.weight"\n',
     "rule 1 uses unknown placeholder {n}"),
    ('[[rule]]\noriginal = "x.{p}"\ndiffusers = "y.{p}"\n', "rule 1 uses {p} without `params`"),
    ('[[rule]]\noriginal = "x.weight"\ndiffusers = "y.weight"\nopp = "split"\n', "rule 1 has unknown fields ['opp']"),
    ('[[rule]]\noriginal = "x.weight"\n', "missing field 'diffusers'"),
    ('[[rule]\noriginal = "x.weight"\n', "cannot read mapping table"),
])
def test_table_errors_are_caught_at_load_time(tmp_path, rules, message):
    with pytest.raises(MappingTableError) as e:
        load(tmp_path, rules)
    assert message in str(e.value)
    assert "toy.toml" in str(e.value)


def test_table_size_names_are_checked_against_the_config(tmp_path):
    table = load(tmp_path, '[[rule]]\noriginal = "x.weight"\ndiffusers = ["y.weight", "z.weight"]\n'
                           'op = { name = "split", dim = 0, sizes = ["hidden", "hidden"] }\n')
    with pytest.raises(MappingTableError, match="size 'hidden' is neither a number nor a config value"):
        table.expand({"num_layers": 1, "inner_dim": 4}, "original")


def test_table_target_produced_twice_is_refused(tmp_path):
    table = load(tmp_path, '[[rule]]\noriginal = "x.weight"\ndiffusers = "y.weight"\n'
                           '[[rule]]\noriginal = "w.weight"\ndiffusers = "y.weight"\n')
    with pytest.raises(MappingTableError, match="target 'y.weight' is also produced by rule 1"):
        table.expand({"num_layers": 1}, "original")


@pytest.mark.parametrize("name", ["flux2", "flux1"])
def test_builtin_table_is_one_source_for_both_directions(name):
    """Each shipped table loads, and its diffusers -> original steps are exactly the inverses of the forward ones."""
    table = builtin_tables()[name]
    config = {"num_layers": 3, "num_single_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8,
              "guidance_embeds": True, **({"mlp_ratio": 3.0} if name == "flux2" else {})}
    sizes = get_family(name).sizes(config)
    forward = table.expand(sizes, "original")
    backward = table.expand(sizes, "diffusers")
    assert len(forward) == len(backward)
    for f, b in zip(forward, backward):
        assert (b.sources, b.targets) == (f.targets, f.sources)
        assert b.op == f.op.inverse()
    targets = [t for s in forward for t in s.targets]
    sources = [k for s in forward for k in s.sources]
    assert len(set(targets)) == len(targets) and len(set(sources)) == len(sources)
    # exactly three kinds of non-rename transform in FLUX.2 (flux2-checkpoints.md 4.2): qkv splits and the final swap
    kinds = sorted({type(s.op).__name__ for s in forward})
    assert kinds == ["Rename", "Split", "SwapHalves"]


# --- byte ranges: what the writer copies file to file must be what `apply` computes ---------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPS))
def test_byte_ranges_give_the_bytes_apply_computes(name, dtype):
    op, in_shapes = OPS[name]
    inputs = [torch.randn(s, generator=torch.Generator().manual_seed(2)).to(dtype) for s in in_shapes]
    ranges = op.byte_ranges([tuple(s) for s in in_shapes], inputs[0].element_size())
    if getattr(op, "dim", 0) != 0:
        assert ranges is None  # not a row move: the engine falls back to reading and applying
        return
    raw = [bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for t in inputs]
    outputs = op.apply(inputs)
    assert len(ranges) == len(outputs)
    for parts, out in zip(ranges, outputs):
        copied = b"".join(raw[i][offset:offset + length] for i, offset, length in parts)
        assert copied == bytes(out.contiguous().view(torch.uint8).reshape(-1).numpy())


def test_cast_has_no_byte_ranges():
    assert Cast(torch.float32, torch.bfloat16).byte_ranges([(4, 4)], 2) is None
