"""Join a group, say so, and hold it open until the test says go (it looks at the process's sockets
meanwhile). Run as a script (psring.init() from the environment), or as a cluster job's
entrypoint (tests.support.jobs.hold_job:main, with args {"flags": DIR})."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any


def hold(rank: int, flags: str) -> None:
    folder = Path(flags)
    (folder / f"ready-{rank}.tmp").write_text(f"{os.getpid()} {os.environ.get('MASTER_PORT', '')}")
    os.replace(folder / f"ready-{rank}.tmp", folder / f"ready-{rank}")
    deadline = time.monotonic() + 90
    while not (folder / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main(group: Any, flags: str) -> dict[str, Any]:
    group.barrier()
    hold(group.rank, flags)
    group.barrier()
    return {"ok": True}


if __name__ == "__main__":
    import psring

    g = psring.init(timeout=60)
    main(g, sys.argv[1])
    g.close()
