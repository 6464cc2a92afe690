"""``python -m bench``: the one benchmark command (see bench/report.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import main  # noqa: E402

sys.exit(main())
