"""Small file helpers every layer shares.

One JSON reader for everything flux-port reads from a user (safetensors headers and their metadata, indexes,
configs, manifests, reports, model_index.json): a depth limit, type checks, and an InputError naming the file (exit
2) instead of a RecursionError, a TypeError or a KeyError further on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from porting.errors import InputError

MAX_JSON_DEPTH = 64  # no config, header, index or report flux-port reads nests deeper than a handful of levels

_KINDS = {dict: "a JSON object", list: "a JSON array", str: "a string"}


def _depth(data: Any) -> int:
    """Nesting depth of parsed JSON (iterative: a deep document cannot exhaust the stack here)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            if level > MAX_JSON_DEPTH:
                return level
            stack.extend((v, level + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(text: str | bytes, where: str, *, kind: type | None = None, what: str = "",
               object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None) -> Any:
    """JSON from `text` read at `where` (a file; `what` names the part of it: "safetensors header", "metadata
    'lora_adapter_metadata'"), nested at most MAX_JSON_DEPTH levels and of type `kind` when given; anything else is
    an InputError naming `where` (and `what`)."""
    subject = f"{where}: {what} is" if what else f"{where}:"
    deep = InputError(f"{subject} JSON nested deeper than {MAX_JSON_DEPTH} levels; refused.",
                      hint="The file is damaged or hostile; no file flux-port reads nests that deep.")
    try:
        data = json.loads(text, object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise deep from None
    except (UnicodeDecodeError, ValueError) as e:
        raise InputError(f"{subject} not valid JSON ({e}).") from e
    if _depth(data) > MAX_JSON_DEPTH:
        raise deep
    if kind is not None and not isinstance(data, kind):
        raise InputError(f"{subject} expected to be {_KINDS.get(kind, kind.__name__)}, found "
                         f"{type(data).__name__}." if what else
                         f"{where}: expected {_KINDS.get(kind, kind.__name__)}, found {type(data).__name__}.")
    return data


def read_json(path: Path, what: str, *, kind: type | None = dict) -> Any:
    """JSON from the file `path` (see parse_json); a missing or unreadable file is an InputError naming it."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: missing ({what}).")
    try:
        text = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror or e}).") from e
    return parse_json(text, str(path), kind=kind)


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from `path`, or an InputError naming the file and what it should be."""
    return read_json(path, what, kind=dict)


_MISSING = object()


def json_int(doc: Any, field: str, where: str | Path, *, default: Any = _MISSING, minimum: int | None = None) -> int:
    """The integer `doc[field]` read from `where`; a string, a float, a bool or a missing field (without a default)
    is an InputError naming the file and the field."""
    if not isinstance(doc, dict):
        raise InputError(f"{where}: expected a JSON object, found {type(doc).__name__}.")
    if field not in doc:
        if default is _MISSING:
            raise InputError(f"{where}: no {field!r} field.")
        return default
    value = doc[field]
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"{where}: {field!r} is {value!r} ({type(value).__name__}); it must be an integer.")
    if minimum is not None and value < minimum:
        raise InputError(f"{where}: {field!r} is {value}; it must be at least {minimum}.")
    return value


# fields of the diffusers configs flux-port reads (transformer, VAE, text encoder) that size tensors: a string or a
# float there would reach torch.empty or a reshape as a traceback, so the config is refused first, naming the field
CONFIG_INTS = ("attention_head_dim", "in_channels", "joint_attention_dim", "num_attention_heads", "num_layers",
               "num_single_layers", "timestep_guidance_channels", "pooled_projection_dim", "out_channels",
               "latent_channels", "hidden_size", "num_hidden_layers", "intermediate_size", "num_key_value_heads",
               "vocab_size", "layers_per_block", "norm_num_groups")
CONFIG_INT_OR_LISTS = ("patch_size", "sample_size")  # a transformer's patch_size is 1, a VAE's is [2, 2]
CONFIG_INT_LISTS = ("axes_dims_rope", "block_out_channels")
CONFIG_NUMBERS = ("mlp_ratio", "eps", "rope_theta")


def check_config(config: dict[str, Any], where: str | Path) -> dict[str, Any]:
    """`config` when its sizing fields have their types (an integer, a list of integers, a number; null where
    diffusers allows it), else an InputError naming the file and the field."""
    for field in CONFIG_INTS:
        value = config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InputError(f"{where}: {field!r} is {value!r} ({type(value).__name__}); it must be a non-negative "
                             "integer.", hint="The config is damaged or hand-edited; take it from the original model.")
    for field in CONFIG_INT_LISTS + CONFIG_INT_OR_LISTS:
        value = config.get(field)
        if field in CONFIG_INT_OR_LISTS and isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            continue
        if value is not None and not (isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
            raise InputError(f"{where}: {field!r} is {value!r}; it must be "
                             + ("an integer or " if field in CONFIG_INT_OR_LISTS else "") + "a list of non-negative "
                             "integers.",
                             hint="The config is damaged or hand-edited; take it from the original model.")
    for field in CONFIG_NUMBERS:
        value = config.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise InputError(f"{where}: {field!r} is {value!r} ({type(value).__name__}); it must be a number.",
                             hint="The config is damaged or hand-edited; take it from the original model.")
    return config


def read_config(path: Path, what: str) -> dict[str, Any]:
    """A model config.json: a JSON object (read_json_object) whose sizing fields are typed (check_config)."""
    return check_config(read_json_object(path, what), path)
