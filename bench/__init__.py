"""tandem's benchmarks, run from the repository root as modules.

The maintained harness lives here: ``python -m bench`` (__main__.py, report.py)
and what it imports (common.py, peer.py, prefix_cache.py, governor.py,
speculative.py, fidelity.py), exactness.py and code_shape.py, the corpora and
the build scripts. One-off experiments are in bench/experiments/
(``python -m bench.experiments.NAME``); bench/README.md says what each measures.
"""
