"""`port export --format onnx --target ryzenai`: the form AMD's Ryzen AI NPU flow takes as it is.

What the profile writes (see docs/export.md, "Target ryzenai"):

- every graph at ONNX opset 17 (Ryzen AI's recommended opset). torch's dynamo exporter writes 18 at the least and
  onnx's version converter has no 18 -> 17 adapter for `Split` and needs constant `axes` for the Reduce ops, so the
  graph is constant-folded (onnxscript) and the few operators whose signature changed at 18 are rewritten here
  (`downgrade_to_17`); the result is checked by `onnx.checker` against opset 17's schemas;
- static shapes, batch 1: one image size (`--size`), one text length (`--text-len`);
- transformer and VAE decoder: BF16 weights with Casts (every float weight initializer stored as bfloat16, followed
  by a `Cast` to float32; compute in float32). This is the form Quark's BF16 flow leaves after its `BF16QDQToCast`
  conversion, which onnxruntime's CPU provider can also run (it has no bf16 MatMul);
- text encoder: int4 `MatMulNBits` (com.microsoft) through onnxruntime's own `matmul_nbits_quantizer`, symmetric,
  `--block-size` (power of two >= 16, default 128) and `--accuracy-level`; the embedding (Gather) and the RMS norms
  stay float32; file `qwen3_text_encoder_prompt_embeds_matmulnbits.onnx`.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from porting.families.export_spec import Traceable
from porting.skeleton import diffusers_skeleton

from .external import padding, save_streamed  # noqa: F401  (save_streamed: used by the export engine)
from .options import (  # noqa: F401  (ryzenai.check_profile, OPSET, the defaults: the CLI's and the tests')
    DEFAULT_BLOCK_SIZE,
    DEFAULT_SIZE,
    DEFAULT_TEXT_LEN,
    OPSET,
    Profile,
    check_profile,
)
from .ort import require

FLOW_FOR = "FLUX.2 [klein]"  # the model this flow is written for; a family's ExportSpec.ryzenai says it is taken
TEXT_ENCODER_FILE = "qwen3_text_encoder_prompt_embeds_matmulnbits.onnx"
FILES = {"transformer": "model.onnx", "vae_decoder": "model.onnx", "text_encoder": TEXT_ENCODER_FILE}
# how each component's weights are stored in the profile
WEIGHTS = {"transformer": "bf16-cast", "vae_decoder": "bf16-cast", "text_encoder": "int4-matmulnbits"}
BF16_MIN_ELEMENTS = 16  # float initializers at least this large are weights (stored bf16); smaller ones are constants
# ops changed at opset 18 whose `axes` moved from an attribute to an input
REDUCE_OPS = {"ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceLogSum",
              "ReduceLogSumExp", "ReduceSumSquare"}
RESIZE_18_ATTRS = {"antialias": 0, "keep_aspect_ratio_policy": b"stretch"}


def graph_file(component: str, size: int, profile: Profile) -> str:
    """The graph file of `component` at `size`: FILES[component] for a one-size export; `model_SIZE.onnx` for a sized
    component (transformer, VAE decoder) when the export has several sizes. Their weights file is always
    FILES[component] + '.data', shared by every size."""
    if component not in SIZED or len(profile.sizes) == 1:
        return FILES[component]
    stem = FILES[component].removesuffix(".onnx")
    return f"{stem}_{size}.onnx"


def _dynamo_export(traced: Any) -> Any:
    """torch.onnx.export with the dynamo exporter at opset 18 (the oldest it writes), quietly; its onnx_ir model."""
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(traced.module, (), kwargs=traced.example, dynamo=True, opset_version=18,
                                    input_names=traced.inputs, output_names=traced.outputs, verbose=False,
                                    optimize=False)
    return program.model


# ---------------------------------------------------------------- static traceables (batch 1, one shape)

def static_transformer(traced: Traceable, profile: Profile) -> Traceable:
    """The transformer's example inputs at batch 1, `size` x `size` pixels and `text_len` tokens, nothing dynamic."""
    from diffusers import Flux2KleinPipeline

    side = profile.size // 16  # VAE 8x, then 2x2 patches
    ex = traced.example
    dtype = ex["hidden_states"].dtype
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, profile.text_len, ex["encoder_hidden_states"].shape[-1], generator=gen).to(dtype)
    example = {"hidden_states": torch.randn(1, side * side, ex["hidden_states"].shape[-1], generator=gen).to(dtype),
               "encoder_hidden_states": ctx, "timestep": torch.full((1,), 0.5, dtype=dtype),
               "img_ids": Flux2KleinPipeline._prepare_latent_ids(torch.empty(1, 1, side, side)),
               "txt_ids": Flux2KleinPipeline._prepare_text_ids(ctx)}
    if "guidance" in ex:
        example["guidance"] = torch.full((1,), 4.0, dtype=dtype)
    return Traceable(traced.module, example, {}, traced.outputs, {**traced.facts, "size": profile.size,
                                                                  "text_len": profile.text_len})


def static_vae_decoder(traced: Traceable, profile: Profile) -> Traceable:
    z = traced.example["latent_sample"]
    side = profile.size // 8
    latents = torch.randn(1, z.shape[1], side, side, generator=torch.Generator().manual_seed(0)).to(z.dtype)
    return Traceable(traced.module, {"latent_sample": latents}, {}, traced.outputs,
                     {**traced.facts, "size": profile.size})


def static_text_encoder(traced: Traceable, profile: Profile) -> Traceable:
    ids = traced.example["input_ids"]
    vocab = int(getattr(traced.module.encoder.config, "vocab_size", int(ids.max()) + 1))
    new = torch.randint(0, vocab, (1, profile.text_len), generator=torch.Generator().manual_seed(0))
    return Traceable(traced.module, {"input_ids": new, "attention_mask": torch.ones_like(new)}, {}, traced.outputs,
                     {**traced.facts, "text_len": profile.text_len})


STREAMED = ("transformer", "vae_decoder")  # bf16-cast, exported with hollow weights, the weights streamed to disk
# the text encoder is streamed too (porting/export/streamed_text.py), its Linear weights quantized as they are read
SIZED = ("transformer", "vae_decoder")  # one graph per --size; the text encoder's shape is the text length only
STATIC = {"transformer": static_transformer, "vae_decoder": static_vae_decoder, "text_encoder": static_text_encoder}


# ---------------------------------------------------------------- graph passes

def trace_static(traced: Traceable) -> Any:
    """torch.onnx.export (dynamo, opset 18: the oldest it writes), static shapes, constants folded; an onnx proto."""
    require("onnxscript")
    import onnx_ir as ir
    import onnxscript.optimizer as opt
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    model = _dynamo_export(traced)
    # a Linear's weight reaches MatMul through a Transpose; name the folded result after the weight (`W.T`) so that
    # MatMulNBits' `W.T_Q4` / `W.T_scales` still say which weight they hold (the folder would call it val_N)
    initializers = model.graph.initializers
    for node in model.graph:
        if node.op_type == "Transpose" and node.inputs and node.inputs[0] is not None \
                and node.inputs[0].name in initializers:
            node.outputs[0].name = node.inputs[0].name + ".T"
    # fold what depends on constants only (Linear weights' transposes, Reduce axes, shape arithmetic): the Reduce
    # ops need constant axes to become opset-17 attributes, MatMulNBits needs a constant B
    opt.fold_constants(model, input_size_limit=2**62, output_size_limit=2**62)
    RemoveUnusedNodesPass()(model)
    proto = ir.serde.serialize_model(model)
    del model
    return proto


def _const_values(proto: Any) -> dict[str, np.ndarray]:
    from onnx import TensorProto, numpy_helper

    values = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer
              if len(t.dims) <= 1 and t.data_location != TensorProto.EXTERNAL}
    for node in proto.graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(a.t)
    return values


def downgrade_to_17(proto: Any) -> Any:
    """Rewrite the operators whose signature changed at opset 18 into their opset-17 form, and stamp opset 17.

    Reduce*: `axes` input (constant) -> attribute. Split: `num_outputs` -> `split` sizes input (static shapes known
    by shape inference). Resize: the opset-18 attributes must hold their defaults (then dropped). Anything else that
    cannot be rewritten raises ValueError naming the node; onnx.checker then checks the result against opset 17.
    """
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.shape_inference.infer_shapes(proto)
    consts = _const_values(proto)
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in list(proto.graph.value_info) + list(proto.graph.input) + list(proto.graph.output)}
    init_shapes = {t.name: list(t.dims) for t in proto.graph.initializer}
    new_inits = []
    for node in proto.graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type in REDUCE_OPS and len(node.input) > 1 and node.input[1]:
            if node.input[1] not in consts:
                raise ValueError(f"{node.name} ({node.op_type}): axes are not a constant; no opset-17 form")
            axes = [int(a) for a in np.atleast_1d(consts[node.input[1]])]
            del node.input[1:]
            node.attribute.append(helper.make_attribute("axes", axes))
        if node.op_type in REDUCE_OPS:
            for a in list(node.attribute):
                if a.name == "noop_with_empty_axes":  # new at 18; 0 (the default) is opset 17's behaviour
                    if a.i:
                        raise ValueError(f"{node.name} ({node.op_type}): noop_with_empty_axes=1 has no opset-17 form")
                    node.attribute.remove(a)
        elif node.op_type == "Split":
            num = next((a for a in node.attribute if a.name == "num_outputs"), None)
            if num is None:
                continue
            axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
            shape = shapes.get(node.input[0]) or init_shapes.get(node.input[0])
            if not shape or shape[axis] is None:
                raise ValueError(f"{node.name} (Split): input shape unknown; no opset-17 form")
            dim, n = shape[axis], int(num.i)
            chunk = -(-dim // n)
            sizes = [chunk] * (dim // chunk) + ([dim % chunk] if dim % chunk else [])
            name = f"{node.name or node.output[0]}_split_sizes"
            new_inits.append(numpy_helper.from_array(np.array(sizes, dtype=np.int64), name))
            node.attribute.remove(num)
            del node.input[1:]
            node.input.append(name)
        elif node.op_type == "Resize":
            for a in list(node.attribute):
                if a.name in RESIZE_18_ATTRS:
                    value = a.i if a.type == onnx.AttributeProto.INT else a.s
                    if value != RESIZE_18_ATTRS[a.name]:
                        raise ValueError(f"{node.name} (Resize): {a.name}={value!r} has no opset-17 form")
                    node.attribute.remove(a)
                elif a.name == "axes":
                    raise ValueError(f"{node.name} (Resize): axes has no opset-17 form")
        elif node.op_type == "Pad" and len(node.input) > 3 and node.input[3]:
            raise ValueError(f"{node.name} (Pad): axes input has no opset-17 form")
    proto.graph.initializer.extend(new_inits)
    used = {name for node in proto.graph.node for name in node.input} | {o.name for o in proto.graph.output}
    kept = [t for t in proto.graph.initializer if t.name in used]  # axes constants now attributes: dropped
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept)
    for op in proto.opset_import:
        if op.domain in ("", "ai.onnx"):
            op.version = OPSET
    del proto.graph.value_info[:]  # re-inferred by whoever loads it; stale opset-18 entries would only mislead
    return proto


def _to_bf16_bits(values: np.ndarray) -> bytes:
    t = torch.from_numpy(np.array(values, dtype=np.float32))  # a writable copy
    return t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()


def bf16_weights_with_casts(proto: Any, weights: set[str], min_elements: int = BF16_MIN_ELEMENTS) -> list[str]:
    """Store every float32 weight initializer (a name in `weights`, the traced module's parameters, or its folded
    transpose `NAME.T`) of at least `min_elements` values as bfloat16 and feed its consumers through
    a `Cast` to float32 (names kept: the bf16 initializer has the weight's name, the cast's output `NAME/fp32`).
    Returns the names converted, one at a time (the float32 copy of each is dropped as soon as it is converted)."""
    from onnx import TensorProto, helper, numpy_helper

    converted, casts = [], []
    for init in proto.graph.initializer:
        if init.data_type != TensorProto.FLOAT or int(np.prod(init.dims)) < min_elements \
                or init.name.removesuffix(".T") not in weights:
            continue  # constants the tracer folded (frequency tables, scales) stay float32
        values = numpy_helper.to_array(init)
        init.ClearField("raw_data")
        init.ClearField("float_data")
        init.data_type = TensorProto.BFLOAT16
        init.raw_data = _to_bf16_bits(values)
        casts.append(helper.make_node("Cast", [init.name], [init.name + "/fp32"], name=init.name + "/cast",
                                      to=TensorProto.FLOAT))
        converted.append(init.name)
    renamed = {n: n + "/fp32" for n in converted}
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            if name in renamed:
                node.input[i] = renamed[name]
    for out in proto.graph.output:
        if out.name in renamed:
            raise ValueError(f"graph output {out.name} is a weight; cannot cast it")
    nodes = casts + list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return converted


def int4_matmulnbits(proto: Any, profile: Profile) -> Any:
    """Every MatMul with a constant float weight -> com.microsoft MatMulNBits, 4 bits, symmetric, blocks of
    `profile.block_size` along K (onnxruntime's own quantizer; embeddings and norms are not MatMuls: untouched)."""
    require("onnxruntime")
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    config = mnq.DefaultWeightOnlyQuantConfig(block_size=profile.block_size, is_symmetric=True,
                                              accuracy_level=profile.accuracy_level, bits=4)
    quant = mnq.MatMulNBitsQuantizer(proto, bits=4, block_size=profile.block_size, is_symmetric=True,
                                     accuracy_level=profile.accuracy_level, algo_config=config)
    quant.process()
    return quant.model.model


def torch_bf16_weights(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """What the export does to a weight, in torch: float weights of at least BF16_MIN_ELEMENTS values rounded to
    bfloat16 (kept in float32 for the compute). The intrinsic run of `port validate` on a ryzenai transformer."""
    if not tensor.is_floating_point() or tensor.numel() < BF16_MIN_ELEMENTS:
        return tensor
    return tensor.to(torch.bfloat16).to(tensor.dtype)


def int4_dequantize_torch(weight: torch.Tensor, block_size: int) -> torch.Tensor:
    """Symmetric int4 block quantization of a Linear weight (out, in) along `in`, as onnxruntime's MatMulNBits
    quantizer does it (scale = the block's largest-magnitude value / -8, codes 0..15 around 8), dequantized."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    pad = (-k) % block_size
    blocks = torch.nn.functional.pad(w, (0, pad)).reshape(n, -1, block_size)
    idx = blocks.abs().argmax(dim=-1, keepdim=True)
    vmax = torch.gather(blocks, -1, idx)
    scale = vmax / -8.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(blocks / safe) + 8, 0, 15)
    deq = torch.where(scale == 0, torch.zeros_like(blocks), (q - 8) * scale)
    return deq.reshape(n, -1)[:, :k].to(weight.dtype)


def finish_component(name: str, traced: Traceable, profile: Profile) -> tuple[Any, dict[str, Any]]:
    """Trace `name` statically and apply the profile; the proto and what was done to it."""
    weights = {k for k, _ in traced.module.named_parameters()}
    proto = trace_static(STATIC[name](traced, profile))
    proto = downgrade_to_17(proto)
    facts: dict[str, Any] = {"weights": WEIGHTS[name], "file": FILES[name]}
    if WEIGHTS[name] == "bf16-cast":
        facts["bf16_initializers"] = len(bf16_weights_with_casts(proto, weights))
    else:
        proto = int4_matmulnbits(proto, profile)
        facts.update(matmulnbits=sum(n.op_type == "MatMulNBits" for n in proto.graph.node),
                     block_size=profile.block_size, symmetric=True, accuracy_level=profile.accuracy_level)
    return proto, facts


def save(proto: Any, dest: Path, file: str) -> None:
    """Save with every tensor over 1 KB in `file`.data, then check by path at opset 17."""
    import onnx

    dest.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(dest / file), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=file + ".data", size_threshold=1024)
    onnx.checker.check_model(str(dest / file))


# ---------------------------------------------------------------- bounded memory: hollow trace, streamed weights

def hollow(module: torch.nn.Module) -> torch.nn.Module:
    """Replace every parameter, and every buffer left on the meta device, by a zero-stride float view of its shape:
    CPU tensors that hold no memory, enough for torch.export (which traces with fake tensors) to see shapes and
    dtypes. The buffers a skeleton computed (rotary tables) keep their values: the trace folds them into the graph."""
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            setattr(m, name, torch.nn.Parameter(torch.zeros((), dtype=torch.float32).expand(p.shape),
                                                requires_grad=False))
        for name, b in list(m.named_buffers(recurse=False)):
            if b.is_meta:
                m._buffers[name] = torch.zeros((), dtype=b.dtype).expand(b.shape)
    return module


def hollow_traceable(name: str, folder: Path, profile: Profile) -> tuple[Traceable, str]:
    """The component's graph module built from its config with hollow weights, static example inputs, and the prefix
    its parameter names carry in the graph. Nothing of the weights is read."""
    from porting._files import read_config
    from porting.families.export_spec import VaeDecoderGraph
    from porting.families.flux2_export import transformer_graph

    cfg = {k: v for k, v in read_config(folder / "config.json", "a component config").items() if not k.startswith("_")}
    if name == "transformer":
        from diffusers import Flux2Transformer2DModel

        model = diffusers_skeleton(Flux2Transformer2DModel, cfg).eval().requires_grad_(False)
        graph = transformer_graph(hollow(model))
        shape = Traceable(graph, {"hidden_states": torch.zeros(1, 16, model.config.in_channels),
                                  "encoder_hidden_states": torch.zeros(1, 6, model.config.joint_attention_dim),
                                  **({"guidance": torch.zeros(1)} if model.config.guidance_embeds else {})},
                          {}, ["sample"], {"timestep": "sigma in [0, 1] (the pipeline's t / 1000)"})
        return static_transformer(shape, profile), "model."
    if name == "vae_decoder":
        from diffusers import AutoencoderKLFlux2

        vae = diffusers_skeleton(AutoencoderKLFlux2, cfg).eval().requires_grad_(False)
        shape = Traceable(VaeDecoderGraph(hollow(vae)), {"latent_sample": torch.zeros(1, vae.config.latent_channels,
                                                                                        2, 2)}, {}, ["sample"], {})
        return static_vae_decoder(shape, profile), "vae."
    raise ValueError(f"{name}: no streamed export")


@dataclass(frozen=True)
class Written:
    """Where a streamed weight sits in the component's weights file: what a second graph of the same component
    (another --size) points at instead of writing it again."""

    offset: int
    length: int
    dtype: Any  # onnx_ir.DataType
    shape: tuple[int, ...]


def _append_weight(data: Any, tensor: torch.Tensor) -> Written:
    """`tensor` rounded to bfloat16 (float32 below BF16_MIN_ELEMENTS) and appended to the open external-data file
    `data`, aligned (onnxruntime maps large tensors from the file); where it went."""
    import onnx_ir as ir

    small = tensor.numel() < BF16_MIN_ELEMENTS
    tensor = tensor.to(torch.float32 if small else torch.bfloat16).contiguous()
    raw = (tensor.view(torch.int16) if not small else tensor).numpy().tobytes()
    offset = data.tell()
    pad = padding(offset, len(raw))
    data.write(b"\0" * pad)
    data.write(raw)
    return Written(offset + pad, len(raw), ir.DataType.FLOAT if small else ir.DataType.BFLOAT16, tuple(tensor.shape))


def stream_bf16_component(name: str, folder: Path, profile: Profile, dest: Path, *, size: int | None = None,
                          written: dict[str, Written] | None = None) -> tuple[Any, dict[str, Any]]:
    """Export a bf16-cast component (transformer, VAE decoder) holding at most one weight tensor at a time.

    The module is traced with hollow weights at `size` (default the profile's first); then every weight is read from
    the safetensors files one tensor at a time, rounded to bfloat16 (float32 when smaller than BF16_MIN_ELEMENTS, as
    in `torch_bf16_weights`) and appended to `dest/FILES[name].data`; the graph's initializers point at it. Returns
    the proto (weights external) and facts.

    `written`: an empty dict is filled with where each weight went; a filled one (from the first size's call) makes
    this graph point at those bytes and write no weight (several sizes, one weights file). A weight this graph needs
    that the first did not write is an error naming it.

    Memory: the hollow graph plus one tensor. Nothing folds a node that reads a streamed weight (onnxscript's folder
    would otherwise load every Linear weight to fold its Transpose, and store the result inline: klein-4B's weights
    in memory and a proto past protobuf's 2 GB), so the proto holds no weight and shape inference runs in memory.
    """
    require("onnxscript")
    import onnx_ir as ir
    import onnxscript.optimizer as opt
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from .weights import ComponentWeights

    size = profile.size if size is None else size
    traced, prefix = hollow_traceable(name, folder, replace(profile, size=size, more_sizes=()))
    model = _dynamo_export(traced)
    params = {k for k, _ in traced.module.named_parameters()}
    dest.mkdir(parents=True, exist_ok=True)
    data_file = FILES[name] + ".data"
    data_path = dest / data_file
    reuse = bool(written)
    written = {} if written is None else written
    index = None if reuse else ComponentWeights(folder)
    weights: set[str] = set()

    def point(value: Any, value_name: str, at: Written) -> None:
        value.const_value = ir.ExternalTensor(data_file, at.offset, at.length, at.dtype, shape=ir.Shape(list(at.shape)),
                                              name=value_name, base_dir=str(dest))
        value.dtype = at.dtype
        if at.dtype == ir.DataType.BFLOAT16:
            weights.add(value_name)

    if reuse:
        for value_name, value in list(model.graph.initializers.items()):
            if value_name not in params:
                continue
            if value_name not in written:
                raise ValueError(f"{name} at --size {size}: weight {value_name} was not written by the first size's "
                                 f"graph into {data_file}")
            point(value, value_name, written[value_name])
    else:
        with open(data_path, "wb") as data:
            for value_name, value in list(model.graph.initializers.items()):
                if value_name in params:
                    key = value_name[len(prefix):] if value_name.startswith(prefix) else value_name
                    if key not in index:
                        raise ValueError(f"{folder}: no tensor {key} in its safetensors files")
                    written[value_name] = _append_weight(data, index.read(key))
                    point(value, value_name, written[value_name])
    # fold only small constants (Reduce axes, shape arithmetic): nothing that reads a streamed weight. onnxscript
    # folds a Transpose of an initializer whatever its size (its `_DEFAULT_ALWAYS_FOLD_OPS`), which loaded every
    # Linear weight from model.onnx.data and stored its transpose inline (the whole model in memory and in the
    # proto, past protobuf's 2 GB); `should_fold` returning False is the only way to stop that
    streamed = {v for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)}
    opt.fold_constants(model, input_size_limit=1024, output_size_limit=1024,
                       should_fold=lambda node: False if any(i in streamed for i in node.inputs) else None)
    RemoveUnusedNodesPass()(model)
    proto = ir.serde.serialize_model(model)
    del model
    proto = downgrade_to_17(proto)
    converted = add_casts(proto, weights)
    return proto, {"weights": WEIGHTS[name], "file": graph_file(name, size, profile), "data_file": data_file,
                   "bf16_initializers": len(converted), "streamed": True, "size": size,
                   "weights_written": not reuse}


def add_casts(proto: Any, weights: set[str]) -> list[str]:
    """A `Cast` to float32 after every bfloat16 weight initializer named in `weights` (consumers renamed)."""
    from onnx import TensorProto, helper

    # every bf16 initializer is a weight or a folded transpose of a small one (the folder may fold those)
    names = [t.name for t in proto.graph.initializer if t.data_type == TensorProto.BFLOAT16]
    casts = [helper.make_node("Cast", [n], [n + "/fp32"], name=n + "/cast", to=TensorProto.FLOAT) for n in names]
    renamed = {n: n + "/fp32" for n in names}
    for node in proto.graph.node:
        for i, n in enumerate(node.input):
            if n in renamed:
                node.input[i] = renamed[n]
    nodes = casts + list(proto.graph.node)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return names
