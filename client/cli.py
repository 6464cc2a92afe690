"""Moved: the command line is ``tandem.cli`` now (``python -m tandem.cli``; the ``tandem``
console script). This forwarder keeps ``python -m tandem.client.cli`` working for what
still names it: units written by an earlier ``tandem service install`` (their ExecStart;
``tandem service install`` again rewrites them). Nothing imports it."""

import runpy

if __name__ == "__main__":
    runpy.run_module("tandem.cli", run_name="__main__", alter_sys=True)
