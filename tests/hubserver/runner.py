"""Child-process entry: apply test-only patches, then run the real `port` command line.

Used by the fork server (zygote.py) and, with FLUX_PORT_TEST_SPAWN=1, as `python -m hubserver.runner REQUEST.json`.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def run(argv: list[str], patches: dict[str, Any]) -> int:
    if "free_bytes" in patches:
        # stands in for the free space of the disk, so the precheck can be exercised without filling one
        import porting.hub.fetch.plan as plan

        plan.disk_free = lambda path: int(patches["free_bytes"])
    from porting.cli.app import main

    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as f:
        request = json.load(f)
    sys.exit(run(request["argv"], request.get("patches", {})))
