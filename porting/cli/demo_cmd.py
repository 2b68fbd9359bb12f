"""`port demo`: the whole path on a tiny model, offline (build, inspect, convert, validate, publish, generate)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from porting.errors import Interrupted
from porting.outputs import check_replaceable, check_writable_parent
from porting.ownership import RECORD, extend_record, read_record, write_record
from porting.reports import REPORTS, run_folder

from . import _output
from ._options import out_option
from .inspect_cmd import describe

if TYPE_CHECKING:
    from porting.demo.bases import TinyBase

PROMPT = "a red fox in the snow"


DEMO_ENTRIES = ("base", "finetune", "transformer", "reports", "published", "demo.png")


def prepare_workdir(workdir: Path) -> None:
    """Empty a work folder an earlier demo wrote, or start a new one; never touch a folder holding anything else
    (every file in it must be one a demo on this machine recorded writing, at the size it wrote it)."""
    check_writable_parent(workdir, option="--workdir")
    if workdir.exists() or workdir.is_symlink():
        check_replaceable(workdir, what="demo work folder", owner_verbs={"demo"}, option="--workdir")
        for path in workdir.iterdir():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.name != RECORD:
                path.unlink()
    created = not workdir.exists()
    workdir.mkdir(parents=True, exist_ok=True)
    _PREPARED.append((workdir, created))  # from here on, everything in workdir is this run's
    write_record(workdir, "demo", [])


_PREPARED: list[tuple[Path, bool]] = []  # the work folder this run emptied or created, and whether it created it


def undo_workdir(workdir: Path, created: bool) -> str:
    """After a failed step: remove what this run wrote in the work folder (all of it: prepare_workdir emptied it
    first), the folder itself when this run created it; returns what was done, for the message."""
    if created:
        shutil.rmtree(workdir, ignore_errors=True)
        return f"The demo removed its partial work folder {workdir}."
    for path in workdir.iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.name != RECORD:
            path.unlink(missing_ok=True)
    try:
        write_record(workdir, "demo", [])
    except OSError:
        (workdir / RECORD).unlink(missing_ok=True)
    return f"The demo removed what it had written in {workdir}; only its ownership record is left."


def _recorded(workdir: Path, entry: str) -> None:
    """Add what a demo step just wrote to the work folder's record, file by file."""
    extend_record(workdir, "demo", [entry])


def interrupted(workdir: Path, running: str) -> Interrupted:
    """Ctrl-C (or SIGTERM) during a demo: remove what the interrupted step had begun (it is not in the work folder's
    record yet, and would make the next demo refuse the folder), and say what the finished steps left."""
    record = read_record(workdir)
    path = workdir / running
    if running and record is not None and running not in record.files and (path.exists() or path.is_symlink()):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    left = sorted(p.name for p in workdir.iterdir() if p.name != RECORD) if workdir.is_dir() else []
    what = (f"{workdir} keeps what the finished steps wrote ({', '.join(left)})" if left
            else f"{workdir} is empty (no step had finished)")
    during = f"while writing {running}, whose partial output was removed" if running else "before its first step"
    return Interrupted(f"Interrupted (Ctrl-C): the demo stopped {during}; {what}.",
                       hint=f"Run port demo --workdir {workdir} again: it reuses the folder and starts over.")


def demo(
    workdir: Annotated[Path, out_option(
        "--workdir", help="Where the demo writes its files: a new folder, or one an earlier demo wrote.")
    ] = Path("demo-out"),
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    family: Annotated[str, typer.Option(
        "--family", help="Which tiny model: klein (FLUX.2 [klein], the default), flux1 (FLUX.1 [dev]), "
                         "flux1-schnell, flux2-dev (FLUX.2 [dev]).")] = "klein",
) -> None:
    """Port a tiny random fine-tune (FLUX.2 [klein] by default) end to end, offline, and generate a PNG with it."""
    from porting.demo.bases import demo_bases
    from porting.errors import EXIT_CHECK_FAILED, PortError

    from ._lastresort import as_port_error

    bases = demo_bases()
    if family not in bases:
        raise PortError(f"--family {family!r}: choose one of {', '.join(bases)}.")
    running: list[str] = []  # the entries of workdir the steps write, the last one the step now running
    _PREPARED.clear()
    try:
        _run(workdir, json_, running, bases[family])
    except KeyboardInterrupt:
        raise interrupted(workdir, running[-1] if running else "") from None
    except Exception as err:  # a step failed (a full disk included): no half-built work folder is left
        if not _PREPARED or getattr(err, "exit_code", None) == EXIT_CHECK_FAILED:
            raise  # refused before anything was written, or a check said no: its report is worth keeping
        mapped = err if isinstance(err, PortError) else as_port_error(err, [str(workdir)])  # names what still exists
        done = undo_workdir(*_PREPARED[-1])
        mapped.details = f"{mapped.details}\n{done}" if mapped.details else done
        if mapped is err:
            raise
        raise mapped from err


def _run(workdir: Path, json_: bool, running: list[str], tiny: TinyBase) -> None:
    from porting.demo.tiny import write_random_checkpoint
    from porting.engine.convert import convert as run_convert
    from porting.pipeline.generate import generate
    from porting.pipeline.publish import publish
    from validation.api import validate

    out = _output.use(json_mode=json_, heavy=True)
    prepare_workdir(workdir)
    steps: dict[str, object] = {"family": tiny.demo, "variant": tiny.variant}

    running.append("base")
    base = tiny.build(workdir / "base", 0)
    _recorded(workdir, 'base')
    out.result(f"[1/6] tiny {tiny.title} base ({tiny.components}): {base}")

    running.append("finetune")
    src = write_random_checkpoint(workdir / "finetune" / f"tiny-{tiny.demo}-finetune.safetensors", tiny.transformer,
                                  seed=1, table=tiny.family)
    _recorded(workdir, 'finetune')
    info = describe(src)
    steps["inspect"] = info
    out.result(f"[2/6] tiny fine-tune in original (BFL) naming: {src}\n"
               f"      inspect: {info['family']} {info['variant']}, naming {info['naming']}, "
               f"{info['tensors']} tensors, "
               f"{info['parameters']:,} parameters, {', '.join(info['dtypes'])}")

    running.append("transformer")
    converted = run_convert(src, workdir / "transformer", strict=True, config=base)
    _recorded(workdir, 'transformer')
    steps["convert"] = converted.to_dict()
    s = converted.plan.summary()
    out.result(f"[3/6] convert --strict --config base: {s['source_tensors']} -> {s['target_tensors']} tensors, "
               f"every key and shape accounted for -> {converted.out}")

    running.append("reports")
    report_dir = run_folder(workdir / REPORTS, "validate")
    report = validate(converted.out, device="cpu", out=report_dir, resolution=64, text_len=32,
                      base=base, prompt=PROMPT)
    _recorded(workdir, 'reports')
    d = report.to_dict()
    steps["validate"] = {k: d[k] for k in ("verdict", "output", "summary", "blame", "weights_sha256")}
    worst = max(b["teacher_forced"]["ratio"] for b in d["blocks"])
    out.result(f"[4/6] validate on cpu in bf16 vs float32 golden: {d['verdict'].upper()}; output error "
               f"{100 * d['output']['device']['rel_l2']:.3g} % = {d['output']['ratio']:.2f}x bf16's own error "
               "(emulated); "
               f"worst block ratio {worst:.2f} (limit {d['rule']['max_ratio']}) -> "
               f"{workdir / REPORTS / 'validate' / report_dir.name / 'report.md'}")

    running.append("published")
    published = publish(base, converted.out, workdir / "published", report=workdir / "reports")
    _recorded(workdir, 'published')
    steps["publish"] = published.to_dict()
    out.result(f"[5/6] publish: {published.out} loads with {published.pipeline}.from_pretrained "
               "(validation gate passed)")

    running.append("demo.png")
    image = workdir / "demo.png"
    g = generate(workdir / "published", PROMPT, device="cpu", steps=4, seed=0, size=64, output=image, progress=False)
    _recorded(workdir, 'demo.png')
    steps["generate"] = {"image": str(image), "load_s": g.load_s, "denoise_s": g.denoise_s, "s_per_it": g.s_per_it}
    out.result(f"[6/6] generate: {image} (64x64, 4 steps; load {g.load_s:.2f} s, denoise {g.denoise_s:.2f} s, "
               f"{g.s_per_it:.3f} s/it)")
    out.document(steps)
