"""``python -m bench``: the one benchmark command (see bench/report.py)."""

import sys

from bench.report import main

sys.exit(main())
