"""Rank FAIL_RANK exits with code 3 after FAIL_AFTER seconds; every other rank sleeps (no collective
would tell it): only the launchers can end them. Prints 'STARTED <rank> <pid>' first."""

import os
import sys
import time

rank = int(os.environ["RANK"])
print(f"STARTED {rank} {os.getpid()}", flush=True)
time.sleep(float(os.environ.get("FAIL_AFTER", "1")))
if rank == int(os.environ.get("FAIL_RANK", "0")):
    sys.exit(3)
time.sleep(120)
