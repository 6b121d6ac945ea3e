"""A stuck job to look at: rank 0 waits in an all_reduce that the other ranks make only once the
file FLAG exists. Run as a script (psring.init() from the environment; prints its result), or as a
cluster job's entrypoint (tests.support.jobs.stuck_job:main, with args {"flag": PATH})."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np


def main(group: Any, flag: str) -> dict[str, Any]:
    if group.rank != 0:
        deadline = time.monotonic() + 120
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)  # busy elsewhere: not in a psring call
    y = group.all_reduce(np.ones(2))
    return {"sum": float(y[0]), "rank": group.rank}


if __name__ == "__main__":
    import psring

    g = psring.init()
    print(json.dumps(main(g, sys.argv[1])), flush=True)
    g.close()
