"""``python -m psring.topology.ps SPEC_JSON``: a process of parameter-server shards.

The spec is run_shards' keyword arguments as JSON (``store`` and ``num_shards`` at least); what it
leaves out comes from the PSRING_* settings, the secret always (never on a command line).
``psring launch`` starts its shard processes this way.
"""

from __future__ import annotations

import json
import sys

from ...transport.loop import new_event_loop
from .shards.server import run_shards


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m psring.topology.ps SPEC_JSON", file=sys.stderr)
        return 2
    spec = json.loads(argv[0])
    loop = new_event_loop()
    try:
        return loop.run_until_complete(run_shards(**spec))
    except KeyboardInterrupt:
        return 130
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
