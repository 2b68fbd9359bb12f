"""The shape of the code: no import cycles (lazy imports included), one dependency direction, a light CLI."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("porting", "validation")
HEAVY = ("torch", "diffusers", "transformers")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules `name` imports anywhere in its body (function-level imports count: they run too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_imports() -> None:
    graph = import_graph()
    assert "validation.api" in graph["porting.cli.validate_cmd"]  # imported inside the command function


def test_no_import_cycles_anywhere() -> None:
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The floors of docs/architecture.md, from the ground up: a room (a top-level file or folder of porting/, or
# validation/) imports only rooms on floors below its own. A new room is given its floor here and in the doc.
FLOORS: dict[int, tuple[str, ...]] = {
    1: ("errors", "text", "charts"),
    2: ("_files", "paths", "progress", "devices", "finite", "seeds"),
    3: ("ownership", "compat", "skeleton"),
    4: ("outputs", "known_digests", "families"),
    5: ("tensors", "reports"),
    6: ("inputs", "hub", "resources", "demo"),
    7: ("engine", "export", "runtime", "environment"),
    8: ("adapters",),
    9: ("pipeline",),
    10: ("validation",),
    11: ("cli",),
    12: ("__main__",),
}
FLOOR_OF = {room: floor for floor, rooms in FLOORS.items() for room in rooms}


def room_of(module: str) -> str:
    parts = module.split(".")
    return "validation" if parts[0] == "validation" else (parts[1] if len(parts) > 1 else "__init__")


def climbing(graph: dict[str, set[str]]) -> list[str]:
    """Each import that reaches a room on its own floor or above, or a room without a floor."""
    wrong = []
    for module, deps in sorted(graph.items()):
        here = room_of(module)
        for dep in sorted(deps):
            there = room_of(dep)
            if there == here or "__init__" in (here, there):
                continue
            if here not in FLOOR_OF or there not in FLOOR_OF:
                wrong.append(f"{module} -> {dep}: give {here if here not in FLOOR_OF else there} a floor in FLOORS")
            elif FLOOR_OF[there] >= FLOOR_OF[here]:
                wrong.append(f"{module} (floor {FLOOR_OF[here]}) -> {dep} (floor {FLOOR_OF[there]})")
    return wrong


def test_no_import_climbs_a_floor() -> None:
    """docs/architecture.md's floors hold: every room imports only rooms below it (lazy imports included)."""
    assert climbing(import_graph()) == []


def test_every_room_has_a_floor() -> None:
    rooms = {room_of(m) for m in project_modules()} - {"__init__"}
    assert sorted(rooms - set(FLOOR_OF)) == []
    assert sorted(set(FLOOR_OF) - rooms) == [], "a room in FLOORS no longer exists: drop it"


def test_the_floor_rule_sees_an_upward_import_and_a_sideways_one() -> None:
    graph = {"porting.tensors.reader": {"porting.engine.convert"}, "porting.engine.plan": {"porting.export.onnx"},
             "porting.cli.app": {"porting.engine.convert"}, "porting.newroom.x": {"porting.errors"}}
    assert climbing(graph) == [
        "porting.engine.plan (floor 7) -> porting.export.onnx (floor 7)",
        "porting.newroom.x -> porting.errors: give newroom a floor in FLOORS",
        "porting.tensors.reader (floor 5) -> porting.engine.convert (floor 7)"]


def test_dependencies_point_one_way() -> None:
    """validation/ builds on porting/; porting/ (the CLI, its composition root, aside) never imports validation/.
    The tensor I/O layer depends on nothing above it."""
    graph = import_graph()
    wrong = sorted((m, d) for m, ds in graph.items() for d in ds
                   if m.startswith("porting.") and not m.startswith("porting.cli") and d.startswith("validation"))
    assert wrong == []
    above = ("porting.engine", "porting.pipeline", "porting.hub", "porting.demo", "porting.cli", "validation")
    wrong = sorted((m, d) for m, ds in graph.items() for d in ds
                   if m.startswith("porting.tensors") and d.startswith(above))
    assert wrong == []


LOADED = "import sys, json; print(json.dumps(sorted(m for m in {heavy} if m in sys.modules)))"


def _heavy_modules_after(argv: list[str]) -> list[str]:
    code = ("import sys, json\nfrom porting.cli.app import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            % argv) + "\n" + LOADED.format(heavy=HEAVY)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["recipes", "--json"], ["convert", "--help"],
                                  ["validate", "--help"], ["env", "--help"]])
def test_light_verbs_never_import_torch_diffusers_or_transformers(argv: list[str]) -> None:
    assert _heavy_modules_after(argv) == []


def test_inspect_of_a_plain_checkpoint_never_imports_torch(tiny2_file: Path) -> None:
    """Headers only: opening, detecting and describing a bf16 file needs neither torch nor diffusers."""
    assert _heavy_modules_after(["inspect", str(tiny2_file), "--json"]) == []


def _quantized_files(folder: Path, state) -> dict[str, Path]:
    """Every quantized layout flux-port reads, tiny, as its producer writes it (tests/quantfiles.py)."""
    from . import quantfiles as qf

    mixed, _, _ = qf.comfy_mixed(state, "nvfp4")
    declared, _, metadata = qf.comfy_mixed(state, "mxfp8", declare="metadata")
    files = {"comfy scaled fp8": qf.save(folder / "scaled.safetensors", qf.comfy_scaled_fp8(state)[0]),
             "comfy_quant nvfp4": qf.save(folder / "mixed.safetensors", mixed),
             "comfy metadata mxfp8": qf.save(folder / "declared.safetensors", declared, metadata),
             "BFL fp8": qf.save(folder / "bfl.safetensors", qf.bfl_fp8(state)[0]),
             "BFL scheme nvfp4": qf.save(folder / "dbfl.safetensors", qf.diffusers_bfl(state)[0]),
             "ModelOpt int8": qf.save(folder / "int8.safetensors", qf.modelopt_int8(state)[0])}
    qf.gguf_file(folder / "q8.gguf", state, "Q8_0")
    return {**files, "GGUF Q8_0": folder / "q8.gguf"}


def test_inspect_of_quantized_files_never_imports_torch(tmp_path: Path, tiny2_state) -> None:
    """The header and the scales' shapes say what a quantized file is: inspect of every layout (one interpreter)
    exits 0, names its layout, and leaves torch, diffusers and transformers unloaded."""
    files = _quantized_files(tmp_path, tiny2_state)
    code = ("import contextlib, io, json, sys\nfrom porting.cli.app import main\nlayouts = []\n"
            f"for path in {[str(p) for p in files.values()]!r}:\n"
            "    out = io.StringIO()\n"
            "    try:\n"
            "        with contextlib.redirect_stdout(out):\n"
            "            main(['inspect', path, '--json'])\n"
            "    except SystemExit as e:\n"
            "        assert not e.code, (path, e.code)\n"
            "    layouts.append(json.loads(out.getvalue())['quantization']['format'])\n"
            f"print(json.dumps([layouts, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    layouts, heavy = json.loads(run.stdout.strip().splitlines()[-1])
    assert heavy == []
    assert len(layouts) == len(files) and all(layouts), layouts
    assert layouts[0] == "ComfyUI scaled fp8" and layouts[-1] == "GGUF"


# Callers outside porting/tensors/ and porting/inputs/ of the functions that open a checkpoint file themselves
# (`open_checkpoint`, `read_header`, safetensors' `safe_open`), each with why it may.
OPENERS = ("open_checkpoint", "read_header", "safe_open")
OPEN_CHECKPOINT_ALLOWED: dict[str, str] = {
    "porting.resources": "estimates memory from the headers of a pipeline's component folders (VAE, text encoders) "
                         "before anything loads; they are not the verb's inputs",
    "porting.demo.lora": "the demo makes its tiny LoRA from the few-kilobyte transformer it has just converted",
}


def open_checkpoint_calls(path: Path, names: tuple[str, ...] = OPENERS) -> list[int]:
    """Lines calling one of `names` by name or as an attribute (`checkpoint.open_checkpoint(...)`), or importing
    it (an import is how a call starts; `import ... as` renames would hide it otherwise)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id in names) or (isinstance(f, ast.Attribute) and f.attr in names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and any(a.name in names for a in node.names):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_only_inputs_opens_checkpoints_outside_the_tensor_layer() -> None:
    """A checkpoint is opened once, at the boundary, as a `porting.inputs.Source` handed down, and read through its
    files' one positioned reader; no verb, engine, exporter or validation module opens one again (outside
    porting/tensors/ and porting/inputs/ nothing calls open_checkpoint, read_header or safe_open)."""
    found = {name: lines for name, path in project_modules().items()
             if not name.startswith(("porting.tensors", "porting.inputs"))
             and (lines := open_checkpoint_calls(path))}
    assert {n: ls for n, ls in found.items() if n not in OPEN_CHECKPOINT_ALLOWED} == {}
    assert set(OPEN_CHECKPOINT_ALLOWED) <= set(found), "an allowed caller no longer opens checkpoints: drop it"
    assert open_checkpoint_calls(ROOT / "porting" / "inputs" / "source.py")


def test_the_open_checkpoint_rule_sees_each_spelling(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from porting.tensors.checkpoint import open_checkpoint\n"
                     "import porting.tensors.checkpoint as c\n"
                     "def f(p):\n    return open_checkpoint(p), c.open_checkpoint(p)\n"
                     "def g(p):\n    from safetensors import safe_open\n    return c.read_header(p)\n")
    assert open_checkpoint_calls(probe) == [1, 4, 6, 7]
