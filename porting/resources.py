"""Memory a run will need, estimated from configs and options before any work, against what the machine has.

One seam for every heavy verb: `port export` (weights of each component), `port validate` (the streamed golden:
the largest stage's weights plus the activations of all cases) and `port compare` / `port generate` (the pipeline's
weights plus, on the CPU, the transformer's activations and the VAE decode). A run whose estimate exceeds the
memory this process may use (the host's available memory, its address-space limit `RLIMIT_AS` and its cgroup's
limit, the tightest of them) is refused with exit 2 and the estimate in the message, instead of swapping for hours
or being killed half-way. The estimates are deliberately simple upper-ish bounds, not measurements; an allocation
that fails anyway is still exit 2, with the last estimate made (`out_of_memory`).
"""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from porting.errors import UsageError

# the interpreter with torch, diffusers and transformers imported (also part of export's estimate)
MEMORY_OVERHEAD = int(1.5 * 2**30)
# copies of the residual stream (batch x tokens x hidden) alive at once while a block runs: the golden, intrinsic
# and device states and their teacher-forced twins, float64 copies for the metrics, attention q/k/v and the MLP's
# gate and up projections (CPU and CUDA attention kernels do not materialise tokens x tokens)
ACTIVATION_COPIES = 24
# the VAE decoder's last up-blocks run at full resolution with 128 channels; a few such tensors are alive at once
VAE_CHANNELS, VAE_COPIES = 128, 8
TEXT_TOKENS = 512  # the FLUX pipelines pad prompts to max_sequence_length 512


class ResourceError(UsageError):
    """The options or the model imply more memory than this machine has (exit 2, before any work)."""


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True)
class Limit:
    """One bound on the memory this process may still take: `available` of `total` bytes, `name` saying whose."""

    name: str
    available: int
    total: int


# cgroup v1 writes "no limit" as 2^63 - 1 rounded down to a page; anything this large is no limit
CGROUP_UNLIMITED = 2**60


def host_limit() -> Limit:
    """The host's available memory (psutil: free plus reclaimable caches)."""
    import psutil

    vm = psutil.virtual_memory()
    return Limit("the host", int(vm.available), int(vm.total))


def mapped_bytes() -> int:
    """This process's address space now (VmSize), what RLIMIT_AS bounds."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


def address_space_limit() -> Limit | None:
    """Room under this process's soft RLIMIT_AS (`ulimit -v`), None without one. The interpreter's share of every
    estimate (MEMORY_OVERHEAD) is mapped already, up to what is mapped now, so it is not counted twice."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        mapped = mapped_bytes()
    except (OSError, ValueError, IndexError):  # no /proc (not Linux): the limit alone
        mapped = 0
    return Limit("the address-space limit (RLIMIT_AS)", max(0, soft - mapped + min(mapped, MEMORY_OVERHEAD)), soft)


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return int(text)
    except (OSError, ValueError):  # absent, unreadable, or "max"
        return None


def _reclaimable(stat: Path, key: str) -> int:
    """Page cache the kernel drops before failing an allocation (`inactive_file` in memory.stat)."""
    try:
        for line in stat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


# per cgroup version: the mounts its hierarchy may be at (under `root`), the limit, usage and memory.stat key
_CGROUP_FILES = {"v2": (("sys/fs/cgroup", "sys/fs/cgroup/unified"), "memory.max", "memory.current", "inactive_file"),
                 "v1": (("sys/fs/cgroup/memory",), "memory.limit_in_bytes", "memory.usage_in_bytes",
                        "total_inactive_file")}


def cgroup_limits(root: Path = Path("/")) -> list[Limit]:
    """The memory limits of this process's cgroups (v2 `memory.max`, v1 `memory.limit_in_bytes`), its own and every
    ancestor's that sets one, each as limit minus usage (page cache the kernel would reclaim not counted as used).
    `root`: where `proc/self/cgroup` and `sys/fs/cgroup` are read (the tests give a fake tree)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        version = "v2" if hierarchy == "0" and controllers == "" else (
            "v1" if "memory" in controllers.split(",") else None)
        if version is None:
            continue
        mounts, limit_file, usage_file, cache_key = _CGROUP_FILES[version]
        for mount in mounts:
            base = root / mount
            folder = base / path.strip("/")
            while True:
                limit = _read_number(folder / limit_file)
                usage = _read_number(folder / usage_file)
                if limit is not None and limit < CGROUP_UNLIMITED:
                    used = max(0, (usage or 0) - _reclaimable(folder / "memory.stat", cache_key))
                    where = "/" + str(folder.relative_to(base)).strip(".")
                    limits.append(Limit(f"the cgroup limit ({limit_file} of {where})", max(0, limit - used), limit))
                if folder == base or base not in folder.parents:
                    break
                folder = folder.parent
    return limits


def memory_limit(root: Path = Path("/")) -> Limit:
    """The tightest of the host's available memory, RLIMIT_AS and the cgroup limits: what this run may still take."""
    limits = [host_limit(), *cgroup_limits(root)]
    space = address_space_limit()
    if space is not None:
        limits.append(space)
    return min(limits, key=lambda limit: limit.available)


@dataclass(frozen=True)
class Estimate:
    """An estimate `require_memory` made: what, the bytes it needs and their breakdown, and what was available."""

    what: str
    need: int
    breakdown: str
    available: int
    limit: str  # whose limit `available` is ("" when the caller gave the figure: a device's free memory)


# the estimates this run made, newest last: an allocation that fails after them is reported with them
ESTIMATES: list[Estimate] = []


def require_memory(what: str, need: int, breakdown: str, *, hint: str, available: int | None = None) -> int:
    """Raise ResourceError when `need` bytes exceed the available memory (default: `memory_limit()`, which names
    the limit that binds); returns `need`. Every estimate is recorded in ESTIMATES."""
    limit = Limit("", available, 0) if available is not None else memory_limit()
    ESTIMATES.append(Estimate(what, need, breakdown, limit.available, limit.name))
    if need > limit.available:
        has = f"{gib(limit.available)} is available" + (f" of {gib(limit.total)}" if limit.total else "")
        if limit.name and limit.name != "the host":
            has += f" under {limit.name}"
        raise ResourceError(f"{what} needs about {gib(need)} of memory ({breakdown}), {has}; nothing was done.",
                            hint=hint)
    return need


# what allocators say when they fail: torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory", "not
# enough memory"), CUDA and other devices ("out of memory"), and the C library (errno 12)
ALLOCATION_FAILED = ("not enough memory", "DefaultCPUAllocator", "can't allocate memory", "out of memory",
                     "Cannot allocate memory")


def allocation_failed(err: BaseException) -> bool:
    """Whether `err` is an allocation refused: MemoryError, or an allocator's RuntimeError / OSError (ENOMEM)."""
    if isinstance(err, MemoryError):
        return True
    if isinstance(err, OSError):
        return err.errno == 12
    return isinstance(err, RuntimeError) and any(s in str(err) for s in ALLOCATION_FAILED)


def out_of_memory(err: BaseException, where: str = "") -> ResourceError:
    """An allocation that failed (`allocation_failed`) as exit 2, with the last estimate made and the limit that
    binds now: the run did not fit, which no estimate is exact enough to rule out."""
    said = str(err).splitlines()[0].strip() if str(err).strip() else ""
    said = f"{type(err).__name__}{': ' + said[:300] if said else ''}"
    try:
        limit = memory_limit()
        now = f"{gib(limit.available)} is available now" + (f" under {limit.name}" if limit.name != "the host" else "")
    except (MemoryError, OSError):  # still short of memory: the estimate alone
        now = "the memory available now could not be read"
    head = f"{where}: " if where else ""
    if not ESTIMATES:
        return ResourceError(f"{head}the run ran out of memory ({said}); {now}; no estimate was made before this "
                             "step.", hint="Lower the sizes or counts the run was given, or raise the memory limit "
                                           "(ulimit -v, the container's limit), or use a machine with more memory.")
    last = ESTIMATES[-1]
    had = f"{gib(last.available)} was available" + (f" under {last.limit}" if last.limit and last.limit != "the host"
                                                     else "")
    return ResourceError(f"{head}the run ran out of memory ({said}): flux-port's estimate was that {last.what} needs "
                         f"about {gib(last.need)} ({last.breakdown}), and {had}; {now}.",
                         hint="The estimate was short of what the run took: lower the sizes or counts it names, "
                              "or raise the memory limit (ulimit -v, the container's limit), or use a machine with "
                              "more memory.")


def itemsize(dtype: Any) -> int:
    """Bytes per element of a torch dtype or a name (bf16, fp16, fp32, fp64)."""
    names = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
    if isinstance(dtype, str):
        return names[dtype]
    return int(dtype.itemsize)


def folder_params(folder: Path) -> int:
    """Parameters stored in the safetensors files of a model folder (headers only; 0 when there are none)."""
    from porting.tensors.checkpoint import read_header

    total = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        tensors, _ = read_header(f)
        total += sum(math.prod(info.shape) for info in tensors.values())
    return total


def hidden_size(config: Mapping[str, Any]) -> int:
    return int(config.get("num_attention_heads", 1)) * int(config.get("attention_head_dim", 1))


def image_tokens(width: int, height: int, vae_scale: int = 8) -> int:
    """Packed latent tokens of a width x height image (VAE /8, then 2x2 patches)."""
    return (width // (vae_scale * 2)) * (height // (vae_scale * 2))


def activation_bytes(config: Mapping[str, Any], tokens: int, batch: int, nbytes: int) -> int:
    """Activations of the transformer on `batch` rows of `tokens` tokens with `nbytes`-byte elements."""
    return ACTIVATION_COPIES * batch * tokens * hidden_size(config) * nbytes


def block_of(key: str) -> str:
    """`name.N` for a key inside a numbered block (`transformer_blocks.3.attn...`), else `other`."""
    parts = key.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else "other"


def stage_params(shapes: Iterable[tuple[str, tuple[int, ...]]],
                 stage_of: Callable[[str], str] | None = None) -> int:
    """Parameters of the largest stage the staged runner materialises at once (a block, or embed + final together:
    the upper bound). `stage_of` names the stage of a key (the family's block templates); default `block_of`."""
    stage_of = stage_of or block_of
    stages: dict[str, int] = {}
    for key, shape in shapes:
        stage = stage_of(key)
        stages[stage] = stages.get(stage, 0) + math.prod(shape)
    return max(stages.values(), default=0)


def encoder_bytes(text_encoders: Sequence[Path]) -> int:
    """The text encoders that encode --prompt, in float32 (a family's pipeline loads all of its encoders at once:
    FLUX.1's CLIP and T5 together); headers only."""
    return sum(folder_params(folder) * 4 for folder in text_encoders if folder.is_dir())


def check_validate_memory(config: Mapping[str, Any], shapes: Iterable[tuple[str, tuple[int, ...]]], *,
                          resolution: int, text_len: int, batch: int, golden_dtype: str, dtype: str,
                          text_encoders: Sequence[Path] = (), available: int | None = None,
                          stage_of: Callable[[str], str] | None = None, ranks: int = 1, encoders: int = 0,
                          where: str = "", hint: str | None = None,
                          candidate: tuple[int, str] | None = None) -> int:
    """`port validate`'s memory where the golden runs (the host on a CPU reference, or a device's free memory): the
    largest stage's weights (streamed), the activations of every case in the golden's dtype, and the text encoders
    in float32 when they encode --prompt (`text_encoders`, or their bytes in `encoders`); `ranks` such processes on
    this host (`--devices`), each as large as one. `where` ("on cuda:0") and `hint` word a device's refusal;
    `candidate`: (bytes, breakdown) of a device under test held in host memory beside the golden (an onnxruntime CPU
    session)."""
    biggest = stage_params(shapes, stage_of)
    weights = biggest * (itemsize(golden_dtype) + 4)  # the stage in the golden's dtype + the tensor read (<= fp32)
    tokens = image_tokens(resolution, resolution) + text_len
    acts = activation_bytes(config, tokens, batch, max(itemsize(golden_dtype), itemsize(dtype), 4))
    encoder = encoders + encoder_bytes(text_encoders)
    held = candidate[0] if candidate else 0
    need = ranks * (MEMORY_OVERHEAD + max(weights + acts + held, encoder))
    breakdown = (f"largest stage {biggest / 1e6:.1f} M parameters {gib(weights)}, activations of {batch} case(s) x "
                 f"{tokens:,} tokens x hidden {hidden_size(config)} {gib(acts)}"
                 + (f", {candidate[1]}" if candidate else "")
                 + (f", text encoder(s) in float32 {gib(encoder)}" if encoder else "")
                 + f", interpreter {gib(MEMORY_OVERHEAD)}")
    if ranks > 1:
        breakdown = f"{ranks} ranks x ({breakdown})"
    return require_memory(f"validating at --resolution {resolution} --text-len {text_len} with a {golden_dtype} "
                          f"golden{' ' + where if where else ''}", need, breakdown, available=available,
                          hint=hint or "Lower --resolution, --text-len or the number of --seeds / --timesteps, or "
                                       "run the golden elsewhere (--reference cuda).")


def check_pipeline_memory(verb: str, components: Mapping[str, Path], config: Mapping[str, Any], *, width: int,
                          height: int, dtype: str, on_cpu: bool, batch: int = 1, extra_tokens: int = 0,
                          available: int | None = None, extra_weight_bytes: int = 0) -> int:
    """A pipeline run (`port compare` side, `port generate`): the weights of `components` in `dtype` on the host
    (from_pretrained loads them there first), plus on the CPU the transformer's activations and the VAE decode.
    `extra_weight_bytes`: weights whose size in memory is known in bytes (an SVDQuant transformer, held packed)."""
    params = {name: folder_params(path) for name, path in components.items() if path is not None}
    weights = sum(params.values()) * itemsize(dtype) + extra_weight_bytes
    acts = vae = 0
    tokens = image_tokens(width, height) + TEXT_TOKENS + extra_tokens
    if on_cpu:
        acts = activation_bytes(config, tokens, batch, itemsize(dtype))
        vae = width * height * VAE_CHANNELS * VAE_COPIES * itemsize(dtype)
    need = MEMORY_OVERHEAD + weights + acts + vae
    breakdown = (f"weights {sum(params.values()) / 1e9:.2f} B parameters in {dtype} {gib(weights)}"
                 + (f", transformer activations ({tokens:,} tokens) {gib(acts)}, VAE decode {gib(vae)}" if on_cpu
                    else "") + f", interpreter {gib(MEMORY_OVERHEAD)}")
    return require_memory(f"{verb} at {width}x{height} in {dtype}", need, breakdown, available=available,
                          hint="Use a smaller --size, a smaller --dtype, or a machine with more memory.")


# the streamed export (port export --target ryzenai: transformer, VAE decoder) holds the traced graph (nodes, no
# weights: klein-9B's is a few hundred MB in torch.export, onnx_ir and the proto together) and one weight at a time
STREAMED_GRAPH_BYTES = int(1.5 * 2**30)


def largest_tensor_bytes(folder: Path) -> tuple[str, int]:
    """(name, float32 bytes) of the largest tensor in a model folder's safetensors files (headers only)."""
    from porting.tensors.checkpoint import read_header

    best = ("", 0)
    for f in sorted(Path(folder).glob("*.safetensors")):
        tensors, _ = read_header(f)
        for key, info in tensors.items():
            size = math.prod(info.shape) * 4
            if size > best[1]:
                best = (key, size)
    return best


def streamed_export_bytes(folder: Path) -> tuple[int, str]:
    """Host memory of a streamed ONNX export: the interpreter, the hollow graph, and the largest weight read (as
    stored, at most float32), converted (float32 -> bf16) and written: about 2 float32 copies of it."""
    name, biggest = largest_tensor_bytes(folder)
    need = MEMORY_OVERHEAD + STREAMED_GRAPH_BYTES + 2 * biggest
    return need, (f"largest weight {name or '-'} 2 x {gib(biggest)} in float32, graph {gib(STREAMED_GRAPH_BYTES)}, "
                  f"interpreter {gib(MEMORY_OVERHEAD)}")


def check_streamed_export_memory(component: str, folder: Path, *, available: int | None = None,
                                 estimate: Callable[[Path], tuple[int, str]] | None = None) -> int:
    """Refuse (exit 2, before any work) a streamed export whose estimate does not fit. `estimate`: a
    component-specific estimate (folder -> (bytes, breakdown)); default `streamed_export_bytes`."""
    need, breakdown = (estimate or streamed_export_bytes)(folder)
    return require_memory(f"{component}: a streamed export", need, breakdown, available=available,
                          hint="The weights are streamed one tensor at a time; free some memory.")


# --- what a config asks to be built --------------------------------------------------------------------------------
# A model is built from its config.json before any weight is read (diffusers' and transformers' from_pretrained,
# the hollow builds of port export), so a config asking for 10^12 layers would allocate (or loop) until killed. Its
# implied size is estimated from the sizing fields first: the parameters of its layers, and the Python objects of
# their modules, which a tiny hidden size does not make small.
LAYER_FIELDS = ("num_layers", "num_single_layers", "num_hidden_layers", "num_decoder_layers", "encoder_layers",
                "decoder_layers")
MODULE_BYTES = 64 * 2**10  # one block's few dozen nn.Module objects, beyond its parameters


def size_field(config: Mapping[str, Any], name: str) -> int:
    """A config's sizing field as a count: 0 when absent, not a number, NaN or negative; at most 2^62."""
    value = config.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        return 0
    return int(min(value, 2**62))


def config_size(config: Mapping[str, Any]) -> tuple[int, int]:
    """(parameters, layers) a component's config implies, an upper-ish estimate: per layer attention and
    modulation (about 10 x hidden^2) and the MLP (3 x hidden x its width), plus the vocabulary's embedding; a nested
    `text_config` (multimodal encoders) counts too; a VAE's levels (`block_out_channels`, `layers_per_block`)."""
    params = layers = 0
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        params, layers = config_size(nested)
    hidden = size_field(config, "hidden_size") or (size_field(config, "num_attention_heads")
                                                    * size_field(config, "attention_head_dim"))
    ratio = config.get("mlp_ratio")
    ratio = ratio if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and 0 < ratio < 1e6 else 4
    width = size_field(config, "intermediate_size") or int(hidden * ratio)
    count = sum(size_field(config, f) for f in LAYER_FIELDS)
    params += count * (10 * hidden * hidden + 3 * hidden * width) + size_field(config, "vocab_size") * hidden
    channels = config.get("block_out_channels")
    if isinstance(channels, list):  # a VAE: per level, encoder and decoder, layers_per_block (+1) 3x3 resnets
        per_level = size_field(config, "layers_per_block") + 1
        sizes = [size_field({"c": c}, "c") for c in channels]
        params += sum(2 * per_level * 18 * c * c for c in sizes)
        count += 2 * per_level * len(sizes)
    return params, layers + count


CONFIG_FLOOR_BYTES = 1  # the fewest bytes per parameter any loader keeps (fp8 / int8): this check is a floor


def check_config_size(what: str, config: Mapping[str, Any], *, nbytes: int = CONFIG_FLOOR_BYTES,
                      available: int | None = None) -> int:
    """Refuse (exit 2, before the model is built) a config whose implied model alone could not fit even at
    `nbytes` bytes per parameter, with its modules: a config asking for far more than any weights hold. The verb's
    own estimate (the stored weights in the run's dtype, the interpreter) follows and decides the real runs."""
    params, layers = config_size(config)
    need = params * nbytes + layers * MODULE_BYTES
    fields = ", ".join(f"{f} {config[f]}" for f in LAYER_FIELDS if size_field(config, f))
    return require_memory(f"{what}: building the model its config describes ({fields or 'no layer count'})", need,
                          f"{params / 1e9:.2f} B parameters {gib(params * nbytes)}, {layers:,} layers' modules "
                          f"{gib(layers * MODULE_BYTES)}", available=available,
                          hint="The config asks for more than the weights can be: check its layer counts and sizes "
                               "against the original model's config.json.")


def check_component_configs(components: Mapping[str, Path], *, nbytes: int = CONFIG_FLOOR_BYTES,
                            available: int | None = None) -> None:
    """`check_config_size` for each component folder's config.json (those without one are left to their loader);
    `nbytes` 0 for a hollow build (port export: no weight is held, only the modules count)."""
    from porting._files import read_json_object

    for name, folder in components.items():
        path = Path(folder) / "config.json"
        if path.is_file():
            check_config_size(f"{path} ({name})", read_json_object(path, f"the {name}'s config"), nbytes=nbytes,
                              available=available)


def check_device_count(option: str, devices: int, stages: int) -> None:
    """Refuse (exit 2, before any rank starts) more devices than the model has pipeline stages."""
    if devices > stages:
        raise ResourceError(f"{option}: {devices:,} devices for a model of {stages} stages; each device needs at "
                            "least one stage, and no rank was started.", hint=f"Use at most {stages} devices.")


def check_ranks_memory(option: str, ranks: int, per_rank: int, breakdown: str, *,
                       available: int | None = None) -> int:
    """Refuse `ranks` processes on this host (validate's ranks, batch's workers) whose memory, each `per_rank`
    bytes, would not fit together."""
    return require_memory(f"{option}: {ranks:,} processes on this host", ranks * per_rank,
                          f"{ranks} x ({breakdown})", available=available,
                          hint=f"Give {option} fewer, or spread the work over several hosts.")


# the example inputs of a static-shape export (port export --target ryzenai): drawn in float32, then cast (two
# copies), with int64 position ids (4 per token)
EXAMPLE_COPIES, ID_BYTES_PER_TOKEN = 2, 4 * 8


def check_static_inputs_memory(sizes: Sequence[int], text_len: int, config: Mapping[str, Any], *,
                               latent_channels: int = 32, available: int | None = None) -> int:
    """Refuse (exit 2, before any tracing) static shapes whose example inputs would not fit: per --size the
    transformer's image tokens (size / 16)^2 x in_channels and the VAE decoder's latents (size / 8)^2 x channels,
    and --text-len tokens x joint_attention_dim."""
    in_ch, joint = size_field(config, "in_channels"), size_field(config, "joint_attention_dim")
    worst = max(sizes)
    tokens = (worst // 16) ** 2
    image = tokens * (in_ch * 4 * EXAMPLE_COPIES + ID_BYTES_PER_TOKEN)
    latents = (worst // 8) ** 2 * latent_channels * 4 * EXAMPLE_COPIES
    text = text_len * (joint * 4 * EXAMPLE_COPIES + ID_BYTES_PER_TOKEN)
    need = MEMORY_OVERHEAD + max(image, latents) + text
    return require_memory(f"exporting static shapes at --size {worst} --text-len {text_len}", need,
                          f"{tokens:,} image tokens x {in_ch} channels {gib(image)}, VAE latents {gib(latents)}, "
                          f"{text_len:,} text tokens x {joint} {gib(text)}, interpreter {gib(MEMORY_OVERHEAD)}",
                          available=available, hint="Use a smaller --size or --text-len (the defaults are what "
                                                    "the Ryzen AI flow runs).")


def check_compare_batch(prompts: int, width: int, height: int, text_dim: int, *, grid_cell: int = 256,
                        available: int | None = None) -> int:
    """`port compare` holds, for every prompt at once, its text embedding (TEXT_TOKENS x `text_dim` in float32),
    both rendered images (RGB bytes) and a grid row of three cells: refuse (exit 2, before any encoding) a prompt
    count whose total would not fit."""
    per_prompt = TEXT_TOKENS * text_dim * 4 + 2 * width * height * 3 + grid_cell * (3 * grid_cell) * 3
    need = MEMORY_OVERHEAD + prompts * per_prompt
    return require_memory(f"comparing {prompts:,} prompt(s) at {width}x{height}", need,
                          f"{prompts:,} x (text embedding {gib(TEXT_TOKENS * text_dim * 4)}, two images "
                          f"{gib(2 * width * height * 3)}, a grid row), interpreter {gib(MEMORY_OVERHEAD)}",
                          available=available, hint="Compare fewer prompts per run (--prompts FILE with fewer "
                                                    "lines), or a smaller --size.")
