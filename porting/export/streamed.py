"""The generic ONNX export (`--target generic`) with bounded memory: each component traced hollow, its weights
written from the safetensors files one tensor at a time.

The family's loader builds the component as usual, but inside `hollow_loading(dtype)` its `from_pretrained` builds the
model from its config with every parameter a zero-stride view in the export dtype (no memory) and every buffer
computed for real (porting/skeleton.py: rotary tables, position ids). torch's dynamo exporter traces it with the
same dynamic axes as the in-memory export; then every parameter initializer is read from the component's files
(converted to the export dtype exactly as `from_pretrained(dtype=...)` does, a tensor at a time) and appended to
`model.onnx.data`, the graph pointing at it. The graph is the in-memory export's, its weights the same bytes.

A component is streamed when every parameter of the hollow module has a tensor of its name (after the graph wrapper's
attribute) in the component's safetensors files, tied parameters under any of their names; a checkpoint whose keys
transformers renames at load (FLUX.2 [dev]'s Mistral3: `language_model.model.*`) is not, and is exported in memory
as before (its estimate checked before any work).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from porting.errors import InputError
from porting.families.export_spec import Traceable
from porting.skeleton import TIES, hollow_loading

from .external import padding, save_streamed
from .ort import require
from .weights import ComponentWeights


def key_map(traced: Traceable, folder: Path) -> tuple[dict[str, str], list[str]]:
    """graph parameter name -> source key, and the names with no source tensor (empty: the component streams)."""
    index = ComponentWeights(folder)
    out, missing = {}, []
    for graph_name, _ in traced.module.named_parameters():
        wrapper, _, name = graph_name.partition(".")
        inner = getattr(traced.module, wrapper)
        candidates = [name] + list(getattr(inner, TIES, {}).get(name, []))
        key = next((c for c in candidates if c in index), None)
        if key is None:
            missing.append(graph_name)
        else:
            out[graph_name] = key
    return out, missing


def hollow_traceable(component: Any, folder: Path, dtype: torch.dtype) -> Traceable:
    """The family's traceable of `component` built hollow (no weight read)."""
    with hollow_loading(dtype):
        return component.load(folder, dtype)


def stream_component(traced: Traceable, folder: Path, keys: dict[str, str], dtype: torch.dtype, opset: int,
                     dims: dict[str, dict[int, Any]], dest: Path, file: str) -> int:
    """Trace the hollow `traced`, write its parameters from `folder` one tensor at a time into `dest/file.data`,
    save `dest/file` and check it by path; the opset produced."""
    import logging
    import warnings

    require("onnx")
    require("onnxscript")
    import onnx_ir as ir

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(traced.module, (), kwargs=traced.example, dynamo=True, opset_version=opset,
                                    dynamic_shapes=dims, input_names=traced.inputs, output_names=traced.outputs,
                                    verbose=False, optimize=False)
    model = program.model
    del program
    dtypes = dict(traced.module.named_parameters())
    index = ComponentWeights(folder)
    dest.mkdir(parents=True, exist_ok=True)
    data_file = file + ".data"
    offset = 0
    with open(dest / data_file, "wb") as data:
        for name, value in list(model.graph.initializers.items()):
            if name not in keys:
                continue
            tensor = index.read(keys[name])
            want = dtypes[name]
            if list(tensor.shape) != list(want.shape):
                raise InputError(f"{index.file(keys[name])}: {keys[name]} has shape {list(tensor.shape)}; the "
                                 f"component's config.json makes it {list(want.shape)}.",
                                 hint="The safetensors files and config.json of this component do not match.")
            tensor = tensor.to(want.dtype).contiguous()
            raw = (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy().tobytes()
            pad = padding(offset, len(raw))
            data.write(b"\0" * pad)
            offset += pad
            data.write(raw)
            value.const_value = ir.ExternalTensor(data_file, offset, len(raw), value.dtype,
                                                  shape=ir.Shape(list(tensor.shape)), name=name, base_dir=str(dest))
            offset += len(raw)
            del tensor, raw
    proto = ir.serde.serialize_model(model)
    del model
    produced = next((int(o.version) for o in proto.opset_import if o.domain in ("", "ai.onnx")), -1)
    save_streamed(proto, dest, file, data_file)  # small constants inline, the rest appended; checked by path
    return produced


def streamed_bytes(folder: Path, dtype: torch.dtype) -> tuple[int, str]:
    """Host memory of a streamed generic export: the interpreter, the hollow graph and the largest tensor as read
    (<= float32) and converted to `dtype`."""
    from porting.resources import MEMORY_OVERHEAD, STREAMED_GRAPH_BYTES, gib, largest_tensor_bytes

    name, biggest = largest_tensor_bytes(folder)
    converted = biggest // 4 * torch.empty((), dtype=dtype).element_size()
    need = MEMORY_OVERHEAD + STREAMED_GRAPH_BYTES + biggest + converted
    return need, (f"largest tensor {name or '-'} {gib(biggest)} in float32 + {gib(converted)} converted, graph "
                  f"{gib(STREAMED_GRAPH_BYTES)}, interpreter {gib(MEMORY_OVERHEAD)}")
