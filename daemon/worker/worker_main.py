"""``python -m tandem.daemon.worker.worker_main``: the entry of every worker process.

The daemon starts it (see worker_handle.py) with a ``WorkerConfig`` as JSON on
stdin. It arranges to die with the daemon, sets the process environment before
llama.cpp is loaded, connects the worker's PAIR socket to the daemon, and runs
the loop of its role: ``TargetLoop`` (target_worker.py), ``DrafterLoop``
(drafter_worker.py) or ``EmbedLoop`` (embedding/embed_worker.py).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
from typing import Optional

import zmq

from .worker_config import WorkerConfig

# Nothing here imports llama_cpp: GOMP_SPINCOUNT is set before llama.cpp (and its OpenMP runtime) is loaded.


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m tandem.daemon.worker.worker_main --sentinel-fd N --parent-pid P``, a WorkerConfig as
    JSON on stdin."""
    ap = argparse.ArgumentParser(
        prog="tandem.daemon.worker.worker_main", description="a tandem model worker (started by the daemon)"
    )
    ap.add_argument("--sentinel-fd", type=int, required=True, help="a pipe's write end, held open while we live")
    ap.add_argument("--parent-pid", type=int, required=True, help="the daemon: we exit if it is gone")
    args = ap.parse_args(argv)
    os.set_inheritable(args.sentinel_fd, False)  # held by this process only, never by anything it starts
    _die_with_parent()
    if os.getppid() != args.parent_pid:  # it died before PR_SET_PDEATHSIG was in place
        sys.exit(1)
    run_worker_process(WorkerConfig.from_dict(json.loads(sys.stdin.read())))


def run_worker_process(config: WorkerConfig) -> None:
    """Set up the process, connect to the daemon, run the role's loop, exit."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a terminal hangup or a reload is the daemon's business
    if config.spin_count is not None:
        os.environ.setdefault("GOMP_SPINCOUNT", str(config.spin_count))
    logging.basicConfig(level=logging.INFO, format=f"tandem[{config.role}] %(levelname)s %(message)s")
    from ..kernels import preload

    preload(config.settings.kernel_patch)  # tandem's CPU kernels, where built: before llama.cpp is loaded
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(config.endpoint)
    try:
        if config.role == "drafter":
            from ..drafting.drafter_worker import DrafterLoop

            DrafterLoop(config, sock).run()
        elif config.role == "embedding":
            from ..embedding.embed_worker import EmbedLoop

            EmbedLoop(config, sock).run()
        else:
            from .target_worker import TargetLoop

            TargetLoop(config, sock).run()
    finally:
        sock.close()  # (what it still has for the daemon goes within its linger)
        ctx.destroy(linger=0)  # the sockets a loop left open (the target's to its drafter): term would wait on them
    sys.exit(0)


if __name__ == "__main__":
    main()
