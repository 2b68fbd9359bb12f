"""Read an adapter file's keys as (module of a mapping table, factor) pairs, in every common naming.

No second list of names: a module is a parameter key of a weight mapping table (mappings/*.toml) without its last
component (`double_blocks.0.img_attn.qkv.weight` -> `double_blocks.0.img_attn.qkv`), in either of the table's
namings. An adapter key is that module written one of two ways, followed by a factor suffix:

- dotted, behind a tool prefix: `diffusion_model.` (BFL / ai-toolkit / ComfyUI), `transformer.` (diffusers),
  `base_model.model.` (peft), `model.diffusion_model.` or none:
  `diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`;
- underscored, behind a head: `lora_unet_` (kohya / musubi-tuner), `lycoris_` (LyCORIS), `lora_transformer_`:
  `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from porting._files import parse_json
from porting.errors import InputError, UnsupportedFormatError
from porting.families import builtin_tables, families
from porting.families.mapping import MappingTable, Naming
from porting.finite import NotFinite, check_number
from porting.tensors.checkpoint import Checkpoint

# factor suffix -> (adapter kind, role). `alpha` belongs to whichever kind the module has.
FACTORS: dict[str, tuple[str, str]] = {
    "lora_down.weight": ("lora", "down"), "lora_up.weight": ("lora", "up"),
    "lora_A.weight": ("lora", "down"), "lora_B.weight": ("lora", "up"),
    "lokr_w1": ("lokr", "w1"), "lokr_w1_a": ("lokr", "w1_a"), "lokr_w1_b": ("lokr", "w1_b"),
    "lokr_w2": ("lokr", "w2"), "lokr_w2_a": ("lokr", "w2_a"), "lokr_w2_b": ("lokr", "w2_b"),
    "hada_w1_a": ("loha", "w1_a"), "hada_w1_b": ("loha", "w1_b"),
    "hada_w2_a": ("loha", "w2_a"), "hada_w2_b": ("loha", "w2_b"),
    "diff": ("diff", "diff"), "diff_b": ("diff", "diff_b"),
    "alpha": ("", "alpha"),
}
UNSUPPORTED = {"dora_scale": "DoRA magnitude vectors", "lokr_t2": "Tucker-factored LoKr (lokr_t2)",
               "hada_t1": "Tucker-factored LoHa (hada_t1)", "hada_t2": "Tucker-factored LoHa (hada_t2)",
               "lora_mid.weight": "LoCon middle (convolution) factors"}
# roles each kind needs (one of each group)
REQUIRED = {"lora": (("down",), ("up",)), "lokr": (("w1", "w1_a"), ("w2", "w2_a")),
            "loha": (("w1_a",), ("w1_b",), ("w2_a",), ("w2_b",)), "diff": (("diff", "diff_b"),)}
PAIRS = {"w1_a": "w1_b", "w1_b": "w1_a", "w2_a": "w2_b", "w2_b": "w2_a"}  # LoKr factored halves

DOT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "base_model.model.", "transformer.", "")
UNDERSCORE_HEADS = ("lora_unet_", "lycoris_", "lora_transformer_")
WIDE = 256  # block count used to name modules before the base's real depth is known


@dataclass(frozen=True)
class ModuleIndex:
    """Every module of one table in both namings, dotted and underscored, with its parameter keys."""

    table: MappingTable
    dotted: Mapping[str, tuple[Naming, str]]
    underscored: Mapping[str, tuple[Naming, str]]
    params: Mapping[tuple[Naming, str], Mapping[str, str]]  # (naming, module) -> {"weight": key, ...}


def naming_config(table: MappingTable) -> dict[str, Any]:
    """A config under which `table.expand` lists every key name: many blocks, every optional rule, unit sizes."""
    config: dict[str, Any] = {f: WIDE for f in table.blocks.values()}
    for rule in table.rules:
        if rule.when:
            config[rule.when] = True
        for size in (rule.op or {}).get("sizes", ()):
            if isinstance(size, str):
                config[size] = 1
    return config


_INDEXES: dict[str, ModuleIndex] = {}


def module_index(table_name: str) -> ModuleIndex:
    """The index of a registered family's table, built once per table (a re-registered family gets a new one)."""
    table = builtin_tables()[table_name]
    index = _INDEXES.get(table_name)
    if index is None or index.table is not table:
        index = _INDEXES[table_name] = build_index(table)
    return index


def build_index(table: MappingTable) -> ModuleIndex:
    dotted: dict[str, tuple[Naming, str]] = {}
    params: dict[tuple[Naming, str], dict[str, str]] = {}
    for step in table.expand(naming_config(table), "original"):
        for naming, keys in (("original", step.sources), ("diffusers", step.targets)):
            for key in keys:
                module, _, param = key.rpartition(".")
                dotted.setdefault(module, (naming, module))
                params.setdefault((naming, module), {})[param] = key
    underscored = {m.replace(".", "_"): v for m, v in dotted.items()}
    return ModuleIndex(table, dotted, underscored, params)


@dataclass
class ModuleAdapter:
    """The adapter factors for one parameter of the model, in the adapter's naming."""

    param: str  # parameter key, e.g. `double_blocks.0.img_attn.qkv.weight`
    kind: str  # lora, lokr, loha, diff
    keys: dict[str, str] = field(default_factory=dict)  # role -> key stored in the file
    alpha: float | None = None

    @property
    def module(self) -> str:
        return self.param.rpartition(".")[0]


@dataclass
class Adapter:
    path: Path
    ckpt: Checkpoint
    table: MappingTable
    naming: Naming
    style: str  # "dotted" or "underscored"
    prefix: str  # the tool prefix or head in front of the module names
    modules: dict[str, ModuleAdapter]  # by parameter key
    unknown: list[tuple[str, str]]  # (stored key, why it was not understood)
    metadata_scale: float | None = None  # peft `lora_alpha / r` from the file's metadata, when it has one

    @property
    def kinds(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.modules.values():
            out[m.kind] = out.get(m.kind, 0) + 1
        return dict(sorted(out.items()))

    @property
    def format(self) -> str:
        """The producer family as users name it."""
        kinds = set(self.kinds)
        if self.prefix == "lycoris_" or kinds & {"lokr", "loha"}:
            return "LyCORIS " + "/".join(sorted(k for k in kinds if k != "diff")) if kinds - {"diff"} else "LyCORIS"
        if kinds == {"diff"}:
            return "ComfyUI full difference (.diff)"
        if self.style == "underscored":
            return "kohya / musubi-tuner"
        if self.naming == "diffusers":
            return "diffusers / peft"
        downup = any(k.endswith(".lora_down.weight") for k in self.ckpt.tensors)
        return "BFL with lora_down/lora_up" if downup else "BFL / ai-toolkit (lora_A/lora_B)"


def _split_factor(key: str) -> tuple[str, str] | None:
    for suffix in sorted([*FACTORS, *UNSUPPORTED], key=len, reverse=True):
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    return None


def _resolve(stem: str, index: ModuleIndex) -> tuple[Naming, str, str, str] | None:
    """(naming, module, style, prefix) for a key stem, or None."""
    for head in UNDERSCORE_HEADS:
        if stem.startswith(head) and stem[len(head):] in index.underscored:
            naming, module = index.underscored[stem[len(head):]]
            return naming, module, "underscored", head
    for prefix in DOT_PREFIXES:
        if stem.startswith(prefix) and stem[len(prefix):] in index.dotted:
            naming, module = index.dotted[stem[len(prefix):]]
            return naming, module, "dotted", prefix
    return None


NOT_A_FACTOR = "not an adapter factor"  # the reason read_adapter gives a key with no factor suffix


def looks_like_adapter(ckpt: Checkpoint) -> bool:
    """Headers only: most keys end in an adapter factor suffix."""
    keys = list(ckpt.tensors)
    hits = sum(1 for k in keys if _split_factor(k) is not None)
    return bool(keys) and hits * 2 > len(keys)


def _peft_scale(metadata: Mapping[str, str], path: Path) -> float | None:
    """`lora_alpha / r` (or / sqrt(r) with rsLoRA) from diffusers' `lora_adapter_metadata`, if present."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return None
    where = f"{path}: metadata 'lora_adapter_metadata'"
    meta = parse_json(raw, str(path), what="metadata 'lora_adapter_metadata'", kind=dict)
    meta = {k.removeprefix("transformer."): v for k, v in meta.items()}
    if meta.get("alpha_pattern") or meta.get("rank_pattern"):
        raise UnsupportedFormatError(f"{path}: peft metadata with per-module alpha_pattern / rank_pattern is not "
                                     "supported yet.", hint="Fold the scales into lora_B and drop the metadata.")
    if "lora_alpha" not in meta or "r" not in meta:
        return None
    for name in ("r", "lora_alpha"):  # numbers (or their text, as some trainers write them), never lists
        if isinstance(meta[name], bool) or not isinstance(meta[name], (int, float, str)):
            raise InputError(f"{where} gives {name} {meta[name]!r} ({type(meta[name]).__name__}); r and lora_alpha "
                             "must be numbers.", hint="Fix the metadata, or drop it and fold the scale into lora_B.")
    try:
        r, alpha = float(meta["r"]), float(meta["lora_alpha"])
    except (OverflowError, TypeError, ValueError) as e:
        raise InputError(f"{where} gives r {meta['r']!r} and lora_alpha {meta['lora_alpha']!r}; both must be "
                         "numbers.") from e
    check_number(alpha, "metadata lora_adapter_metadata lora_alpha", path)
    if not (math.isfinite(r) and r > 0):
        raise NotFinite(f"{path}: metadata 'lora_adapter_metadata' gives rank r = {meta['r']!r}; a rank is a positive "
                        "number, and alpha / r would be undefined. Nothing was written.",
                        hint="Fix the metadata, or drop it and fold the scale into lora_B.")
    return alpha / (r ** 0.5 if meta.get("use_rslora") else r)


# per kind: (role, dim) pairs whose size is a rank (the inner dimension of a product of factors)
RANK_DIMS = {"lora": (("down", 0), ("up", 1)), "loha": (("w1_a", 1), ("w1_b", 0), ("w2_a", 1), ("w2_b", 0)),
             "lokr": (("w1_a", 1), ("w1_b", 0), ("w2_a", 1), ("w2_b", 0))}


def _check_rank(ckpt: Checkpoint, m: ModuleAdapter, path: Path) -> None:
    """A factored module with rank 0 has no difference to add, and alpha / rank divides by zero: refused."""
    for role, dim in RANK_DIMS.get(m.kind, ()):
        if role in m.keys:
            shape = ckpt.tensors[m.keys[role]].shape
            if len(shape) == 2 and shape[dim] <= 0:
                raise NotFinite(f"{path}: {m.keys[role]!r} has shape {list(shape)}: rank {shape[dim]} for "
                                f"{m.param}; a rank must be at least 1 (alpha / rank is undefined). Nothing was "
                                "written.", hint="The adapter is damaged; export it again from the trainer.")


# what an adapter's factors and differences are stored in; fp8 factors (some trainers save them to halve the file)
# are read upcast to float32 like the others
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")


def _check_numbers(ckpt: Checkpoint, m: ModuleAdapter, path: Path) -> None:
    """Factors are floating-point numbers, an alpha is not a boolean, and a LoRA's two factors chain (down [r, in],
    up [out, r]): anything else would be merged as if it were float, or fail at merge time. Refused by key."""
    for role, key in m.keys.items():
        info = ckpt.tensors[key]
        if role == "alpha":
            if info.dtype == "BOOL":
                raise InputError(f"{path}: alpha {key!r} is a boolean; an alpha is a number. Nothing was written.",
                                 hint="The adapter is damaged or was written by a broken exporter.")
            continue
        if info.dtype not in FLOAT_DTYPES:
            raise InputError(f"{path}: {m.kind} factor {key!r} is stored as {info.dtype}; adapter factors are "
                             f"floating-point ({', '.join(FLOAT_DTYPES)}). Nothing was written.",
                             hint=f"{info.dtype} is not a dtype trainers store factors in; export the adapter "
                                  "again in bf16, fp16 or fp32.")
    if m.kind in ("lokr", "loha"):
        _check_halves(ckpt, m, path)
    if m.kind == "lora":
        down, up = ckpt.tensors[m.keys["down"]], ckpt.tensors[m.keys["up"]]
        if len(down.shape) != 2 or len(up.shape) != 2 or down.shape[0] != up.shape[1]:
            raise InputError(f"{path}: LoRA factors of {m.param} do not chain: {m.keys['down']!r} "
                             f"{list(down.shape)} and {m.keys['up']!r} {list(up.shape)} (down is [rank, in], up "
                             "[out, rank]). Nothing was written.", hint="The adapter is damaged; export it again.")


def _check_halves(ckpt: Checkpoint, m: ModuleAdapter, path: Path) -> None:
    """A LoKr or LoHa factor stored as halves (X_a [rows, rank] @ X_b [rank, cols]) must chain, a LoKr factor is
    given once (whole or as halves, not both), and LoHa's two products must have one shape: anything else is
    refused by key at read time (merge and adapter convert alike), not written out for merge to refuse later."""
    kind = "LoKr" if m.kind == "lokr" else "LoHa"
    shapes = {}
    for name in ("w1", "w2"):
        a, b = m.keys.get(f"{name}_a"), m.keys.get(f"{name}_b")
        if name in m.keys and (a or b):
            raise InputError(f"{path}: {kind} factor {name} of {m.param} is given both whole ({m.keys[name]!r}) and "
                             f"as halves ({a or b!r}); which one applies is unknown. Nothing was written.",
                             hint="The adapter is damaged; export it again.")
        if a is None or b is None:
            continue
        sa, sb = ckpt.tensors[a].shape, ckpt.tensors[b].shape
        if len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0]:
            raise InputError(f"{path}: {kind} factors of {m.param} do not chain: {a!r} {list(sa)} and {b!r} "
                             f"{list(sb)} ({name}_a is [rows, rank], {name}_b [rank, cols]). Nothing was written.",
                             hint="The adapter is damaged; export it again.")
        shapes[name] = (sa[0], sb[1])
    if m.kind == "loha" and len(shapes) == 2 and shapes["w1"] != shapes["w2"]:
        raise InputError(f"{path}: LoHa halves of {m.param} do not match: w1_a @ w1_b is {list(shapes['w1'])}, "
                         f"w2_a @ w2_b {list(shapes['w2'])} (their elementwise product needs one shape). Nothing "
                         "was written.", hint="The adapter is damaged; export it again.")


def _best_table(keys: list[str], prefer: str | None = None) -> ModuleIndex:
    """The table naming the most keys; a tie goes to `prefer` (the family of the base it is meant for), else to the
    family that declares the higher adapter priority."""
    ranked = sorted(families(), key=lambda f: (f.name != prefer, -f.adapter_priority, f.name))
    scored = []
    for order, family in enumerate(ranked):
        index = module_index(family.name)
        hits = sum(1 for k in keys if (s := _split_factor(k)) and _resolve(s[0], index))
        scored.append((hits, -order, index))
    return max(scored, key=lambda t: (t[0], t[1]))[2]


def read_adapter(ckpt: Checkpoint, table: MappingTable | None = None, prefer: str | None = None) -> Adapter:
    """Sort an opened adapter's keys into modules (headers, plus its scalar alphas); `prefer`: the family that reads
    keys several tables know equally (the base's, when there is one). A path is opened by `porting.inputs`."""
    path = ckpt.path
    keys = sorted(ckpt.tensors)
    if table is None:
        index = _best_table(keys, prefer)
    elif builtin_tables().get(table.name) is table:
        index = module_index(table.name)
    else:
        index = build_index(table)
    modules: dict[str, ModuleAdapter] = {}
    unknown: list[tuple[str, str]] = []
    seen: dict[tuple[str, str], int] = {}
    alphas: dict[str, str] = {}
    for key in keys:
        split = _split_factor(key)
        if split is None:
            unknown.append((key, f"{NOT_A_FACTOR} (no lora_A/B, lora_down/up, lokr_, hada_, diff suffix)"))
            continue
        stem, suffix = split
        if suffix in UNSUPPORTED:
            unknown.append((key, f"{UNSUPPORTED[suffix]} are not supported"))
            continue
        found = _resolve(stem, index)
        if found is None:
            unknown.append((key, f"module {stem!r} is not a {index.table.name} module in any naming"))
            continue
        naming, module, style, prefix = found
        seen[(style, prefix)] = seen.get((style, prefix), 0) + 1
        kind, role = FACTORS[suffix]
        names = index.params[(naming, module)]
        if role == "alpha":
            alphas[f"{naming}:{module}"] = key
            continue
        param = names.get("bias") if role == "diff_b" else names.get("weight", next(iter(names.values())))
        if param is None:
            unknown.append((key, f"module {module!r} has no bias in {index.table.name}"))
            continue
        entry = modules.setdefault(f"{naming}:{param}", ModuleAdapter(param, kind))
        if entry.kind != kind:
            unknown.append((key, f"module {module!r} mixes {entry.kind} and {kind} factors"))
            continue
        entry.keys[role] = key
    namings = {k.split(":", 1)[0] for k in modules}
    if len(namings) > 1:
        raise InputError(f"{path}: adapter mixes original and diffusers module names.",
                         hint="Split it into one file per naming.")
    naming: Naming = namings.pop() if namings else "original"
    _apply_alphas(ckpt, modules, alphas, unknown)
    modules = _complete(modules, unknown)
    for m in modules.values():
        _check_numbers(ckpt, m, path)
        _check_rank(ckpt, m, path)
    if not keys:
        raise InputError(f"{path}: the adapter holds no tensors; there is nothing to merge or convert.",
                         hint="Check that the download or export finished.")
    style, prefix = max(seen, key=seen.get) if seen else ("dotted", "")
    return Adapter(path, ckpt, index.table, naming, style, prefix,
                   {m.param: m for m in modules.values()}, unknown, _peft_scale(ckpt.metadata, path))


def _apply_alphas(ckpt: Checkpoint, modules: dict[str, ModuleAdapter], alphas: dict[str, str],
                  unknown: list[tuple[str, str]]) -> None:
    """Each scalar alpha (`naming:module` -> its key) onto its module's factors; an alpha without factors is
    unknown, one that is not a single number is refused."""
    path = ckpt.path
    for tag, key in alphas.items():
        _, module = tag.split(":", 1)
        targets = [m for m in modules.values() if m.module == module and m.kind != "diff"]
        if not targets:
            unknown.append((key, "alpha without factors for its module"))
            continue
        info = ckpt.tensors[key]
        if info.shape not in ((), (1,)):
            raise NotFinite(f"{path}: alpha {key!r} has shape {list(info.shape)}; an alpha is one number (a scalar), "
                            "so which value scales the module is unknown. Nothing was written.",
                            hint="The adapter is damaged or not in a format flux-port reads.")
        value = check_number(float(ckpt.read(key).float().reshape(-1)[0]), f"alpha {key!r}", path)
        for m in targets:
            m.alpha = value
            m.keys["alpha"] = key


def _complete(modules: dict[str, ModuleAdapter], unknown: list[tuple[str, str]]) -> dict[str, ModuleAdapter]:
    """The modules with every factor their kind needs; the others' keys are listed as unknown, saying what lacks."""
    for m in modules.values():
        missing = [group for group in REQUIRED[m.kind] if not any(r in m.keys for r in group)]
        if m.kind == "lokr":
            missing += [(PAIRS[r],) for r in m.keys if r in PAIRS and PAIRS[r] not in m.keys]
        if missing:
            unknown.append((sorted(m.keys.values())[0], f"{m.kind} factors for {m.param} lack "
                                                        f"{' and '.join('/'.join(g) for g in missing)}"))
            m.kind = "incomplete"
    modules = {tag: m for tag, m in modules.items() if m.kind != "incomplete"}
    return modules

