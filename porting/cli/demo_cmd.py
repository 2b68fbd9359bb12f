"""`port demo`: the whole path on a tiny model, offline (build, inspect, convert, validate, publish, generate)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, Optional

import typer

from porting.errors import Interrupted

from . import _output
from ._options import out_option

if TYPE_CHECKING:
    from porting.demo.bases import TinyBase

PROMPT = "a red fox in the snow"


# porting.outputs / ownership / reports are imported by the functions that use them: `port demo --help` stays light
DEMO_ENTRIES = ("base", "finetune", "transformer", "reports", "published", "demo.png", "lora", "merged")
DEFAULT_ROOT = Path("demo-out")


def _owned(workdir: Path) -> dict[str, object]:
    from porting.ownership import read_record

    record = read_record(workdir)
    return record.files if record else {}


def _clear(workdir: Path, rel: str, owned: dict[str, object]) -> None:
    """Remove what the demo's record lists at `rel`: a file, or a folder whose every entry it lists; in a folder
    holding something it does not list (a report run folder `port validate` wrote for the user), only the listed
    entries, recursively. A record file inside is kept unless its whole folder goes."""
    from porting.ownership import RECORD, is_flux_port_staging

    path = workdir / rel
    if not path.is_dir() or path.is_symlink():
        if rel in owned:
            _remove(path)
        return
    for leftover in [p for p in path.rglob("*") if p.is_dir() and is_flux_port_staging(p)]:
        shutil.rmtree(leftover, ignore_errors=True)  # what an interrupted flux-port run left: never the user's
    entries = [p.relative_to(workdir).as_posix() for p in path.rglob("*")]
    if all(e in owned for e in entries):
        shutil.rmtree(path, ignore_errors=True)
        return
    for child in sorted(path.iterdir()):
        child_rel = f"{rel}/{child.name}"
        if child.name != RECORD and (child_rel in owned or any(k.startswith(f"{child_rel}/") for k in owned)):
            _clear(workdir, child_rel, owned)


def others_inside(workdir: Path, tops: list[str]) -> list[str]:
    """The folders inside the demo's own entries that another verb wrote (a report of `port validate` run on
    `published/transformer`, say): on no demo record, each with a record of its own."""
    from porting.ownership import read_record

    owned = _owned(workdir)
    found = []
    for top in tops:
        path = workdir / top
        if not path.is_dir() or path.is_symlink():
            continue
        for root, dirs, _ in os.walk(path, followlinks=False):
            for name in sorted(dirs):
                rel = (Path(root) / name).relative_to(workdir).as_posix()
                if rel not in owned and read_record(Path(root) / name) is not None:
                    found.append(rel)
            dirs[:] = [d for d in dirs if (Path(root) / d).relative_to(workdir).as_posix() in owned]
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _prune_reports(workdir: Path, removed: list[str]) -> None:
    """Remove the `reports/<verb>/` folders (and then `reports/`) that held the report run folders in `removed`
    (the demo's own, just removed) when nothing but their ownership record is left in them."""
    from porting.ownership import RECORD
    from porting.reports import REPORTS

    root = workdir / REPORTS
    verbs = {rel.split("/")[1] for rel in removed if rel.startswith(f"{REPORTS}/") and rel.count("/") >= 2}
    if not verbs or not root.is_dir() or root.is_symlink():
        return
    for folder in [*(root / verb for verb in sorted(verbs)), root]:
        if folder.is_dir() and not folder.is_symlink() and all(p.name == RECORD for p in folder.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)


def _a_demo_folder(workdir: Path) -> bool:
    """Whether `workdir` is a demo's work folder (its record, sealed on this machine, says `port demo` made it) whose
    entries that flux-port cannot prove it wrote all lie outside what the demo replaces: those (an image `port
    generate` wrote, a file of the user's) are kept as they are. One in the way (an edited demo.png, a file put in
    base/) is refused, named, before anything changes."""
    from porting.outputs import UnsafeOutputError
    from porting.ownership import foreign_entries, read_record
    from porting.reports import REPORTS

    if workdir.is_symlink() or not workdir.is_dir():
        return False
    record = read_record(workdir)
    foreign = foreign_entries(workdir) if record is not None and record.verb == "demo" else None
    if foreign is None:
        return False
    in_the_way = [f for f in foreign if f.split("/")[0] in DEMO_ENTRIES and f.split("/")[0] != REPORTS]
    if in_the_way:
        shown = ", ".join(repr(f) for f in in_the_way[:5]) + (
            f" and {len(in_the_way) - 5} more" if len(in_the_way) > 5 else "")
        raise UnsafeOutputError(
            f"{workdir}: a new demo would replace {shown}, which flux-port did not write (or was changed since); "
            "nothing was changed.",
            hint=f"Move {in_the_way[0]} out of {workdir}, or run the demo elsewhere: port demo --workdir OTHER.")
    return True


def prepare_workdir(workdir: Path) -> None:
    """Start a new work folder, or clear what an earlier demo wrote in this one; never touch a folder an earlier demo
    did not make. What other verbs wrote in it (reports of `port validate` / `compare` / `bench`, another verb's
    `--out`, an image of `port generate`) and any other file beside the demo's own entries is kept as it is; when
    such an output sits inside an entry the demo replaces, the demo refuses, naming it."""
    from porting.outputs import UnsafeOutputError, check_replaceable, check_writable_parent
    from porting.ownership import write_record
    from porting.reports import REPORTS

    check_writable_parent(workdir, option="--workdir")
    if workdir.exists() or workdir.is_symlink():
        if not _a_demo_folder(workdir):
            check_replaceable(workdir, what="demo work folder", owner_verbs={"demo"}, option="--workdir")
        owned = _owned(workdir)
        tops = [name for name in DEMO_ENTRIES if name in owned or any(k.startswith(f"{name}/") for k in owned)]
        kept = others_inside(workdir, [t for t in tops if t != REPORTS])
        if kept:
            shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
            raise UnsafeOutputError(
                f"{workdir}: a new demo would replace {', '.join(sorted({k.split('/')[0] for k in kept}))}, which "
                f"holds what another port command wrote ({shown}); nothing was changed.",
                hint=f"Move {kept[0]} out of {workdir}, or run the demo elsewhere: port demo --workdir OTHER.")
        for name in tops:
            _clear(workdir, name, owned)
        _prune_reports(workdir, list(owned))
    created = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    _PREPARED.append((workdir, created))  # from here on, what the steps write in workdir is this run's
    write_record(workdir, "demo", [])


_PREPARED: list[tuple[Path, bool]] = []  # the work folder this run cleared or created, and whether it created it


def undo_workdir(workdir: Path, created: bool, written: list[str] | None = None) -> str:
    """After a failed step: remove what this run wrote in the work folder (the entries in `written`), the folder
    itself when this run created it; returns what was done, for the message."""
    from porting.ownership import RECORD, write_record

    if created:
        shutil.rmtree(workdir, ignore_errors=True)
        return f"The demo removed its partial work folder {workdir}."
    for name in written or ():
        _remove(workdir / name)
    _prune_reports(workdir, list(written or ()))
    try:
        write_record(workdir, "demo", [])
    except OSError:
        (workdir / RECORD).unlink(missing_ok=True)
    kept = sorted(p.name for p in workdir.iterdir() if p.name != RECORD)
    return (f"The demo removed what it had written in {workdir}; "
            + (f"what other commands wrote there is kept ({', '.join(kept)})." if kept
               else "only its ownership record is left."))


def _recorded(workdir: Path, entry: str) -> None:
    """Add what a demo step just wrote to the work folder's record, file by file (`entry` may be a path inside it:
    the demo's own report run folder, `reports/validate/<time>`)."""
    from porting.ownership import extend_record

    extend_record(workdir, "demo", [entry])


def interrupted(workdir: Path, running: str) -> Interrupted:
    """Ctrl-C (or SIGTERM) during a demo: remove what the interrupted step had begun (it is not in the work folder's
    record yet, and would make the next demo refuse the folder), and say what the finished steps left."""
    from porting.ownership import RECORD, read_record

    record = read_record(workdir)
    path = workdir / running
    if running and record is not None and running not in record.files and (path.exists() or path.is_symlink()):
        _remove(path)
        _prune_reports(workdir, [running])
    left = sorted(p.name for p in workdir.iterdir() if p.name != RECORD) if workdir.is_dir() else []
    what = (f"{workdir} keeps what the finished steps wrote ({', '.join(left)})" if left
            else f"{workdir} is empty (no step had finished)")
    during = f"while writing {running}, whose partial output was removed" if running else "before its first step"
    return Interrupted(f"Interrupted (Ctrl-C): the demo stopped {during}; {what}.",
                       hint=f"Run port demo --workdir {workdir} again: it reuses the folder and starts over.")


def demo(
    workdir: Annotated[Optional[Path], out_option(
        "--workdir", help="Where the demo writes its files: a new folder, or one an earlier demo wrote (default "
                          "demo-out/FAMILY: each family its own folder). What other port commands wrote there is "
                          "kept.")] = None,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    family: Annotated[str, typer.Option(
        "--family", help="Which tiny model: klein (FLUX.2 [klein], the default), klein-wide (the same with widths "
                         "multiples of 128, which the Nunchaku 4-bit writers take), flux1 (FLUX.1 [dev]), "
                         "flux1-schnell, flux2-dev (FLUX.2 [dev]).")] = "klein",
    lora: Annotated[bool, typer.Option(
        "--lora", help="Three more steps: a tiny LoRA made for the tiny base, inspected against it (its effect on "
                       "each module), merged into the port and the merged transformer validated.")] = False,
) -> None:
    """Port a tiny random fine-tune (FLUX.2 [klein] by default) end to end, offline, and generate a PNG with it."""
    from porting.demo.bases import demo_bases
    from porting.errors import EXIT_CHECK_FAILED, PortError

    from ._lastresort import as_port_error

    bases = demo_bases()
    if family not in bases:
        raise PortError(f"--family {family!r}: choose one of {', '.join(bases)}.")
    workdir = DEFAULT_ROOT / family if workdir is None else workdir
    running: list[str] = []  # the entries of workdir the steps write, the last one the step now running
    _PREPARED.clear()
    try:
        _run(workdir, json_, running, bases[family], lora)
    except KeyboardInterrupt:
        raise interrupted(workdir, running[-1] if running else "") from None
    except Exception as err:  # a step failed (a full disk included): no half-built work folder is left
        if not _PREPARED or getattr(err, "exit_code", None) == EXIT_CHECK_FAILED:
            raise  # refused before anything was written, or a check said no: its report is worth keeping
        mapped = err if isinstance(err, PortError) else as_port_error(err, [str(workdir)])  # names what still exists
        done = undo_workdir(*_PREPARED[-1], running)
        mapped.details = f"{mapped.details}\n{done}" if mapped.details else done
        if mapped is err:
            raise
        raise mapped from err


LARGE_INTRINSIC = 0.05  # above 5 %, bf16's own error needs a word: a tiny random model, not the port


def validate_line(d: dict, report: Path, step: str = "[4/6]", what: str = "") -> str:
    """The demo's validate step in words: the output error is the relative L2 distance from the float32 output, and
    the verdict compares it with the error bf16 itself makes on the same model (the ratio), not with zero."""
    output, limit = d["output"], d["rule"]["max_ratio"]
    device, intrinsic, ratio = output["device"]["rel_l2"], output["intrinsic"]["rel_l2"], output["ratio"]
    worst = max((b["teacher_forced"]["ratio"] for b in d["blocks"]), default=None)
    verdict = d["verdict"].upper()
    why = f"the port's error is {ratio:.2f}x bf16's own; up to {limit}x passes"
    large = ("\n      (both are large on this tiny random-weight model: the verdict is the ratio)"
             if intrinsic > LARGE_INTRINSIC else "")
    how = {"emulated": " (rounding emulated in float32)", "native": " (bf16 kernels)"}.get(d.get("intrinsic"), "")
    return (f"{step} validate{what} on cpu, bf16 against a float32 golden: {verdict}\n"
            f"      output error {100 * device:.3g} % (relative L2 distance from the float32 output);\n"
            f"      bf16 itself costs {100 * intrinsic:.3g} % on this model{how}:\n"
            f"      {why}{large}\n"
            + (f"      worst block ratio {worst:.2f} (limit {limit}) -> {report}" if worst is not None
               else f"      -> {report}"))


def _say(out: _output.Output, text: str) -> None:
    """A step's lines, wrapped to the console's width (80 columns off a terminal)."""
    from porting.text import wrap_lines

    out.result(wrap_lines(text, out.out.width))


def _run(workdir: Path, json_: bool, running: list[str], tiny: TinyBase, lora: bool = False) -> None:
    from porting.demo.tiny import write_random_checkpoint
    from porting.engine.convert import convert as run_convert
    from porting.pipeline.generate import generate
    from porting.pipeline.publish import publish
    from porting.reports import REPORTS, run_folder
    from validation.api import validate

    out = _output.use(json_mode=json_, heavy=True)
    prepare_workdir(workdir)
    steps: dict[str, object] = {"family": tiny.demo, "variant": tiny.variant}
    total = 9 if lora else 6

    def n(i: int) -> str:
        return f"[{i}/{total}]"

    running.append("base")
    base = tiny.build(workdir / "base", 0)
    _recorded(workdir, 'base')
    _say(out, f"{n(1)} tiny {tiny.title} base ({tiny.components}): {base}")

    running.append("finetune")
    src = write_random_checkpoint(workdir / "finetune" / f"tiny-{tiny.demo}-finetune.safetensors", tiny.transformer,
                                  seed=1, table=tiny.family)
    _recorded(workdir, 'finetune')
    from .inspect_cmd import describe  # the inspect verb's reading, imported when the demo reaches it

    info = describe(src)
    steps["inspect"] = info
    _say(out, f"{n(2)} tiny fine-tune in original (BFL) naming: {src}\n"
               f"      inspect: {info['family']} {info['variant']}, naming {info['naming']}, "
               f"{info['tensors']} tensors, "
               f"{info['parameters']:,} parameters, {', '.join(info['dtypes'])}")

    running.append("transformer")
    converted = run_convert(src, workdir / "transformer", strict=True, config=base)
    _recorded(workdir, 'transformer')
    steps["convert"] = converted.to_dict()
    s = converted.plan.summary()
    _say(out, f"{n(3)} convert --strict --config base: {s['source_tensors']} -> {s['target_tensors']} tensors, "
               f"every key and shape accounted for -> {converted.out}")

    report_dir = run_folder(workdir / REPORTS, "validate")
    running.append(f"{REPORTS}/validate/{report_dir.name}")
    report = validate(converted.out, device="cpu", out=report_dir, resolution=64, text_len=32,
                      base=base, prompt=PROMPT)
    _recorded(workdir, running[-1])
    d = report.to_dict()
    steps["validate"] = {k: d[k] for k in ("verdict", "output", "summary", "blame", "weights_sha256")}
    _say(out, validate_line(d, workdir / REPORTS / "validate" / report_dir.name / "report.md", n(4)))

    running.append("published")
    published = publish(base, converted.out, workdir / "published", report=workdir / "reports")
    _recorded(workdir, 'published')
    steps["publish"] = published.to_dict()
    _say(out, f"{n(5)} publish: {published.out} loads with {published.pipeline}.from_pretrained "
               "(validation gate passed)")

    running.append("demo.png")
    image = workdir / "demo.png"
    g = generate(workdir / "published", PROMPT, device="cpu", steps=4, seed=0, size=64, output=image, progress=False)
    _recorded(workdir, 'demo.png')
    steps["generate"] = {"image": str(image), "load_s": g.load_s, "denoise_s": g.denoise_s, "s_per_it": g.s_per_it}
    _say(out, f"{n(6)} generate: {image} (64x64, 4 steps; load {g.load_s:.2f} s, denoise {g.denoise_s:.2f} s, "
               f"{g.s_per_it:.3f} s/it)")
    if lora:
        _lora_steps(workdir, running, base, converted.out, steps, out, n)
    out.document(steps)


def _lora_steps(workdir: Path, running: list[str], base: Path, transformer: Path, steps: dict[str, object],
                out: _output.Output, n: Callable[[int], str]) -> None:
    """`--lora`: a tiny LoRA for the port, its effect on each module of it, merged, and the merge validated."""
    from porting.adapters.base_effect import effect_on_base
    from porting.adapters.effect import summary_lines
    from porting.adapters.merge import merge
    from porting.demo.lora import write_tiny_lora
    from porting.reports import REPORTS, run_folder
    from validation.api import validate

    running.append("lora")
    adapter = write_tiny_lora(workdir / "lora" / "tiny-lora.safetensors", transformer)
    _recorded(workdir, "lora")
    effect = effect_on_base(adapter, transformer)
    steps["lora"] = {"file": str(adapter), "effect": effect}
    lines = summary_lines(effect)
    detail = []
    for line in lines[1:]:  # "  weakest: MODULE (numbers)": the numbers on a line of their own, within 80 columns
        head, _, numbers = line.strip().partition(" (")
        detail += [f"      {head}", f"        ({numbers}"] if numbers else [f"      {head}"]
    _say(out, f"{n(7)} tiny LoRA (rank 4, diffusers naming, attention projections):\n      {adapter}\n"
               f"      inspect --base transformer: {lines[0].split(': ', 1)[1]}" + "".join(f"\n{d}" for d in detail))

    running.append("merged")
    merged = merge(transformer, [(adapter, 1.0)], workdir / "merged")
    _recorded(workdir, "merged")
    steps["merge"] = merged.to_dict()
    _say(out, f"{n(8)} merge tiny-lora.safetensors x1 into the port, every module placed:\n      {merged.out}")

    report_dir = run_folder(workdir / REPORTS, "validate")
    running.append(f"{REPORTS}/validate/{report_dir.name}")
    report = validate(merged.out, device="cpu", out=report_dir, resolution=64, text_len=32, base=base, prompt=PROMPT)
    _recorded(workdir, running[-1])
    d = report.to_dict()
    steps["validate_merged"] = {k: d[k] for k in ("verdict", "output", "summary", "blame", "weights_sha256")}
    _say(out, validate_line(d, workdir / REPORTS / "validate" / report_dir.name / "report.md", n(9), " (merged)"))
