"""``python -m tandem.cli``: the ``tandem`` command, as the console script runs it."""

import sys

from .main import main

if __name__ == "__main__":
    sys.exit(main())
