"""One-off experiments, each answering one question: ``python -m bench.experiments.NAME``
from the repository root. bench/README.md cites their results and the command that
reproduced each."""
