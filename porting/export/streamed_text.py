"""The ryzenai text encoder exported with bounded memory: traced hollow, its weights read one tensor at a time from
the bf16 safetensors files, each Linear weight quantized to 4-bit `MatMulNBits` blocks as it is read.

1. The encoder is built on the meta device from its config, its parameters replaced by zero-stride views (nothing in
   memory; `ryzenai.hollow`) and its rotary tables kept as the skeleton computed them (a checkpoint does not store
   them), then traced once by torch's dynamo exporter with the profile's static shapes. Every parameter becomes an
   initializer that points at a placeholder file: the graph holds no weight, so onnx's in-memory shape inference and
   the opset-17 rewrite work on it whatever the model's size (protobuf's 2 GB limit is never approached).
2. The graph's initializers are then filled from the source files one tensor at a time, in graph order:
   - a Linear weight W (out, in), which the trace feeds to `MatMul` through `Transpose`, is read, transposed to
     (K=in, N=out) in float32 and quantized by onnxruntime's own block quantizer (`DefaultWeightOnlyQuantizer
     .qbits_block_quant`, the very function `MatMulNBitsQuantizer` calls for each weight); the `Transpose` + `MatMul`
     pair becomes one `com.microsoft:MatMulNBits` reading `W.T_Q4` / `W.T_scales`, named and shaped as
     `MatMulNBitsQuantizer` names them in the in-memory export;
   - every other weight (the embedding, the RMS norms) is written in float32, the embedding in row chunks.
   At most one Linear weight is held in float32 (twice: as read and transposed).
3. Tied embeddings: the trace reads the input embedding as `model.embed_tokens.weight`; a checkpoint that stores only
   `lm_head.weight` (tied) is read from there. Qwen3-4B stores no `lm_head`, Qwen3-8B stores both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from porting.errors import InputError
from porting.families.export_spec import Traceable
from porting.skeleton import empty_weights

from .external import padding
from .ort import require

PENDING = "__flux_port_pending__.data"  # where the hollow trace's initializers point until their bytes are written
CHUNK_BYTES = 64 * 2**20  # float32 rows written at a time for a tensor that is not quantized (the embedding)
TIED = {"model.embed_tokens.weight": "lm_head.weight", "lm_head.weight": "model.embed_tokens.weight"}


@dataclass(frozen=True)
class Linear:
    weight: str  # the initializer (graph name) of W (out, in)
    transpose: Any  # the Transpose node
    matmuls: list[Any]  # the MatMul nodes that read W.T as input B


def hollow_text_encoder(folder: Path, profile: Any) -> tuple[Traceable, str]:
    """The Qwen3 text encoder graph (hidden states of the pipeline's layers, stacked) built from `folder`'s config
    with hollow weights and real rotary tables, at the profile's static text length; and its parameter prefix."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    from porting.families.flux2_export import TEXT_ENCODER_LAYERS, TextEncoderGraph, encoder_layers

    from .ryzenai import hollow, static_text_encoder

    cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
    with warnings.catch_warnings(), empty_weights():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg)
    model = hollow(model.eval().requires_grad_(False))  # the rotary tables the skeleton computed are kept
    hollow_buffers = [name for name, b in model.named_buffers() if b.numel() > 1 and b.stride() and
                      max(b.stride()) == 0]
    if hollow_buffers:
        raise ValueError(f"{folder}: buffer {hollow_buffers[0]} was built on the meta device, not computed; the "
                         "hollow trace would read zeros for it")
    layers = encoder_layers(cfg.num_hidden_layers, TEXT_ENCODER_LAYERS)
    ids = torch.zeros(1, 2, dtype=torch.long)
    shape = Traceable(TextEncoderGraph(model, layers), {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                      {}, ["prompt_embeds"], {"hidden_states_layers": list(layers)})
    return static_text_encoder(shape, profile), "encoder."


def _linears(proto: Any, pending: set[str]) -> dict[str, Linear]:
    """The pending initializers the graph uses as Linear weights: W -> Transpose(perm 1,0) -> MatMul input B only."""
    consumers: dict[str, list[tuple[Any, int]]] = {}
    for node in proto.graph.node:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, i))
    out = {}
    for name in pending:
        uses = consumers.get(name, [])
        if len(uses) != 1 or uses[0][0].op_type != "Transpose":
            continue
        node = uses[0][0]
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        users = consumers.get(node.output[0], [])
        if perm == [1, 0] and users and all(n.op_type == "MatMul" and i == 1 for n, i in users):
            out[name] = Linear(name, node, [n for n, _ in users])
    return out


class _Source:
    """The component's tensors, one at a time, through each file's one reader (`weights.ComponentWeights`)."""

    def __init__(self, folder: Path, prefix: str) -> None:
        from .weights import ComponentWeights

        self.folder, self.prefix = folder, prefix
        self.index = ComponentWeights(folder)

    def key(self, graph_name: str) -> str:
        key = graph_name[len(self.prefix):] if graph_name.startswith(self.prefix) else graph_name
        if key not in self.index and TIED.get(key) in self.index:  # a tied embedding stored under its twin's name
            return TIED[key]
        if key not in self.index:
            raise InputError(f"{self.folder}: no tensor {key} in its safetensors files (the text encoder graph "
                             f"reads it as {graph_name}" + (f"; nor its tied twin {TIED[key]}" if key in TIED else "")
                             + ").", hint="The text encoder folder is incomplete or not a Qwen3 checkpoint.")
        return key

    def read(self, key: str, rows: slice | None = None) -> torch.Tensor:
        return self.index.read(key, rows)

    def shape(self, key: str) -> list[int]:
        return self.index.shape(key)


def _external(tensor: Any, location: str, offset: int, length: int) -> None:
    from onnx import TensorProto

    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = k, v


def int4_blocks(w_t: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """onnxruntime's symmetric 4-bit block quantization of B = W.T (K, N) float32: (packed (N, blocks, block/2)
    uint8, scales (N, blocks) float32), the arithmetic `MatMulNBitsQuantizer` applies to each MatMul weight."""
    require("onnxruntime")
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq

    config = mnq.DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=True, bits=4)
    packed, scales, _ = mnq.DefaultWeightOnlyQuantizer(config).qbits_block_quant(w_t)
    return packed, scales


class _Appender:
    """Appends tensors' bytes to the external-data file, each tensor's start aligned for mmap."""

    def __init__(self, data: Any) -> None:
        self.data, self.offset = data, 0

    def write(self, raw: bytes, align: int | None = None) -> int:
        """Append `raw`; `align`: the whole tensor's size when `raw` starts a tensor. Returns where it starts."""
        pad = padding(self.offset, align) if align is not None else 0
        self.data.write(b"\0" * pad)
        self.offset += pad
        start = self.offset
        self.data.write(raw)
        self.offset += len(raw)
        return start


def _hollow_proto(folder: Path, profile: Any, dest: Path) -> tuple[Any, str, Any]:
    """(the traced graph as an opset-17 proto with every weight a PENDING placeholder, the weights' name prefix, the
    hidden-state layers it returns)."""
    import onnx_ir as ir
    import onnxscript.optimizer as opt
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    from .ryzenai import _dynamo_export, downgrade_to_17

    traced, prefix = hollow_text_encoder(folder, profile)
    model = _dynamo_export(traced)
    params = {k for k, _ in traced.module.named_parameters()}
    layers = traced.facts["hidden_states_layers"]
    del traced
    for name, value in list(model.graph.initializers.items()):
        if name in params:  # no bytes: a placeholder until the weight is read
            shape = [int(d) for d in value.const_value.shape]
            value.const_value = ir.ExternalTensor(PENDING, 0, 4 * math.prod(shape), ir.DataType.FLOAT,
                                                  shape=ir.Shape(shape), name=name, base_dir=str(dest))
    pending_values = {v for v in model.graph.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)}
    # fold what depends on constants only (mask, positions, rotary tables, Reduce axes): never a node reading a weight
    opt.fold_constants(model, input_size_limit=2**62, output_size_limit=2**62,
                       should_fold=lambda node: False if any(i in pending_values for i in node.inputs) else None)
    RemoveUnusedNodesPass()(model)
    proto = ir.serde.serialize_model(model)
    del model
    return downgrade_to_17(proto), prefix, layers


def _location(t: Any) -> str | None:
    return next((e.value for e in t.external_data if e.key == "location"), None)


def _as_nbits(t: Any, lin: Any, weight: Any, out: _Appender, data_file: str, profile: Any,
              replaced: dict[str, list[Any]]) -> list[Any]:
    """A Linear's weight quantized to int4 blocks and written; its MatMuls replaced by MatMulNBits (in `replaced`).
    Returns the new initializers (codes, scales)."""
    from onnx import TensorProto, helper

    w_t = np.ascontiguousarray(weight.to(torch.float32).numpy().T)  # (K, N)
    k, n = w_t.shape
    packed, scales = int4_blocks(w_t, profile.block_size)
    del w_t
    q_name, s_name = f"{t.name}.T_Q4", f"{t.name}.T_scales"
    q_t = TensorProto(name=q_name, data_type=TensorProto.UINT8, dims=list(packed.shape))
    _external(q_t, data_file, out.write(packed.tobytes(), packed.nbytes), packed.nbytes)
    s_t = TensorProto(name=s_name, data_type=TensorProto.FLOAT, dims=list(scales.shape))
    _external(s_t, data_file, out.write(scales.astype(np.float32).tobytes(), scales.nbytes), scales.nbytes)
    attrs = {"K": k, "N": n, "bits": 4, "block_size": profile.block_size}
    if profile.accuracy_level:  # as onnxruntime's quantizer: 0 / unset is left out
        attrs["accuracy_level"] = profile.accuracy_level
    replaced[lin.transpose.output[0]] = []
    for mm in lin.matmuls:
        replaced[mm.output[0]] = [helper.make_node("MatMulNBits", [mm.input[0], q_name, s_name], list(mm.output),
                                                   name=(mm.name + "_Q4") if mm.name else "", domain="com.microsoft",
                                                   **attrs)]
    return [q_t, s_t]


def _as_float_chunks(t: Any, key: str, want: list[int], source: _Source, out: _Appender, data_file: str) -> None:
    """A tensor that is not a Linear (embedding, norms) in float32, written in row chunks of at most CHUNK_BYTES."""
    from onnx import TensorProto

    rows = max(1, CHUNK_BYTES // (4 * max(1, math.prod(want[1:]))))
    chunks = [slice(r, r + rows) for r in range(0, want[0], rows)] if want else [None]
    start = None
    for chunk in chunks:
        part = source.read(key, chunk).to(torch.float32).contiguous()
        at = out.write(part.numpy().tobytes(), align=4 * math.prod(want) if start is None else None)
        start = at if start is None else start
        del part
    t.data_type = TensorProto.FLOAT
    _external(t, data_file, start or 0, 4 * math.prod(want))


def _rewire(proto: Any, replaced: dict[str, list[Any]], dropped: set[str], new_inits: list[Any]) -> None:
    """The graph with each replaced node's stand-ins, the dropped initializers gone and the new ones added."""
    from onnx import helper

    nodes = []
    for node in proto.graph.node:
        nodes.extend(replaced.get(node.output[0], [node]) if node.output else [node])
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    kept = [t for t in proto.graph.initializer if t.name not in dropped]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept + new_inits)
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))


def stream_int4_text_encoder(folder: Path, profile: Any, dest: Path) -> tuple[Any, dict[str, Any]]:
    """Export the text encoder of `folder` into `dest` (graph proto returned, its weights already in
    `dest/TEXT_ENCODER_FILE.data`), with every Linear as int4 MatMulNBits quantized as it is read."""
    require("onnxscript")
    from .ryzenai import FILES, WEIGHTS

    proto, prefix, layers = _hollow_proto(folder, profile, dest)
    pending = {t.name for t in proto.graph.initializer if _location(t) == PENDING}
    linears = _linears(proto, pending)
    source = _Source(folder, prefix)
    file = FILES["text_encoder"]
    data_file = file + ".data"
    dest.mkdir(parents=True, exist_ok=True)
    replaced: dict[str, list[Any]] = {}  # a node's first output -> what takes its place (MatMulNBits, or [] drops it)
    new_inits, dropped = [], set()
    with open(dest / data_file, "wb") as data:
        out = _Appender(data)
        for t in list(proto.graph.initializer):
            if t.name not in pending:
                continue
            key, want = source.key(t.name), list(t.dims)
            have = source.shape(key)
            if have != want:
                raise InputError(f"{folder}: {key} has shape {have}; its config.json makes it {want}.",
                                 hint="The safetensors files and config.json of the text encoder do not match.")
            if t.name in linears:
                new_inits += _as_nbits(t, linears[t.name], source.read(key), out, data_file, profile, replaced)
                dropped.add(t.name)
            else:
                _as_float_chunks(t, key, want, source, out, data_file)
    _rewire(proto, replaced, dropped, new_inits)
    left = [t.name for t in proto.graph.initializer if _location(t) == PENDING]
    if left:
        raise ValueError(f"{folder}: {left[0]} was not written (an internal error)")
    return proto, {"weights": WEIGHTS["text_encoder"], "file": file, "data_file": data_file,
                   "matmulnbits": len(linears), "block_size": profile.block_size, "symmetric": True,
                   "accuracy_level": profile.accuracy_level, "streamed": True,
                   "hidden_states_layers": list(layers)}


def streamed_text_encoder_bytes(folder: Path) -> tuple[int, str]:
    """Host memory of the streamed int4 text encoder export: the interpreter, the hollow graph, the largest Linear
    weight as read, in float32 and transposed (about 2.5 float32 copies), and one embedding chunk."""
    from porting.resources import MEMORY_OVERHEAD, STREAMED_GRAPH_BYTES, gib

    from .weights import ComponentWeights

    best = ("", 0)
    for key, info in ComponentWeights(Path(folder)).view.tensors.items():
        if "embed" in key or key.startswith("lm_head") or len(info.shape) != 2:
            continue  # written in chunks, or small
        if math.prod(info.shape) * 4 > best[1]:
            best = (key, math.prod(info.shape) * 4)
    need = MEMORY_OVERHEAD + STREAMED_GRAPH_BYTES + int(2.5 * best[1]) + CHUNK_BYTES
    return need, (f"largest Linear {best[0] or '-'} 2.5 x {gib(best[1])} in float32, embedding chunk "
                  f"{gib(CHUNK_BYTES)}, graph {gib(STREAMED_GRAPH_BYTES)}, interpreter {gib(MEMORY_OVERHEAD)}")
