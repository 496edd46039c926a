"""`python -m moe8 ...`: the `moe8` command (moe8.cli)."""

import sys

from moe8.cli import main

sys.exit(main())
