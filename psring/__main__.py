"""python -m psring: the psring command line."""

import sys

from .cli import main

sys.exit(main())
