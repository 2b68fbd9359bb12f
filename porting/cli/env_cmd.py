"""`port env`: flux-port's version and what it runs on (versions, builds, extras, devices, folders)."""

from __future__ import annotations

from . import _output
from ._options import JsonOpt

ENV_EXAMPLES = """\b
Examples:
  port env
  port env --json > env.json    (attach it to a bug report)
"""

FOLDER_LABELS = {"state": "state (output seal key)", "workspace": "workspace (port fetch)",
                 "hf_cache": "Hugging Face cache", "modelscope_cache": "ModelScope cache"}


def env(json_: JsonOpt = False) -> None:
    """Print flux-port's version, Python, torch and its builds, the libraries, the extras installed, the visible
    devices and the folders flux-port uses: what a bug report needs."""
    from rich.table import Table

    from porting.environment import environment

    output = _output.use(json_mode=json_)
    doc = environment()
    output.document(doc)
    table = Table(title="port env", show_header=False)
    table.add_row("flux-port", doc["flux_port"])
    table.add_row("python", doc["python"])
    table.add_row("platform", doc["platform"])
    for name, version in doc["packages"].items():
        table.add_row(name, version or "not installed")
    if "torch_error" in doc:
        table.add_row("torch import", doc["torch_error"])
    else:
        table.add_row("torch CUDA build", doc["cuda_build"] or "none")
        table.add_row("torch ROCm build", doc["rocm_build"] or "none")
    extras = doc["extras"]
    table.add_row("extras installed", ", ".join(k for k, v in extras.items() if v) or "none")
    table.add_row("extras missing", ", ".join(k for k, v in extras.items() if not v) or "none")
    for d in doc.get("devices", []):
        facts = ", ".join(f"{k} {v}" for k, v in d.items() if k != "device" and v is not None)
        table.add_row(f"device {d['device']}", facts or "available")
    for name, value in doc["visible_devices_env"].items():
        table.add_row(name, value)
    for name, folder in doc["folders"].items():
        table.add_row(FOLDER_LABELS.get(name, name), folder)
    output.table(table)
