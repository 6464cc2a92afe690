"""``tandem kernels build|status``: tandem's CPU kernels (daemon/kernels: llama.cpp's CPU backend with
tandem's patch, built once per llama-cpp-python version and CPU)."""

from __future__ import annotations

from .common import say


def add_kernels(sub) -> None:
    p = sub.add_parser(
        "kernels",
        help="tandem's CPU kernels: build them (once), or say which a daemon would use",
        description="tandem's CPU kernels: llama.cpp's CPU backend, built from the sources of the installed "
        "llama-cpp-python with tandem's patch (its attention for decoding steps reads the KV in fixed chunks, "
        "evenly over the threads: faster at long contexts, exact as before). A daemon builds them at its first start "
        "(--kernel-patch auto, the default; this command builds them beforehand). Building downloads the "
        "sources from PyPI and needs cmake, patch and a C++ compiler on PATH.",
    )
    ksub = p.add_subparsers(dest="kernels_command", metavar="ACTION")
    b = ksub.add_parser("build", help="download llama-cpp-python's sources, patch and build (about a minute)")
    b.add_argument("--jobs", type=int, default=None, help="compile jobs (default: one per CPU)")
    ksub.add_parser("status", help="whether they are built for this llama-cpp-python and CPU, and where")


def cmd_kernels(args) -> int:
    from tandem.daemon import kernels

    if args.kernels_command == "build":
        try:
            path = kernels.build(say=say, jobs=args.jobs)
        except kernels.KernelBuildError as e:
            say(f"error: {e}")
            return 1
        print(f"tandem's CPU kernels: {path}")
        return 0
    if args.kernels_command == "status":
        path = kernels.built()
        if path is None:
            print(
                f"not built for llama-cpp-python {kernels.llama_cpp_version()} on this CPU: daemons run llama.cpp's "
                "own (`tandem kernels build` builds them)"
            )
            why = kernels.failed()
            if why is not None:
                print(f"the last build failed (a daemon tries again {kernels.RETRY_SECONDS // 3600} hours after it):")
                print("\n".join("    " + line for line in why.splitlines()))
            return 1
        print(f"built: {path} (daemons use them unless --kernel-patch off)")
        return 0
    say("usage: tandem kernels build [--jobs N] | tandem kernels status")
    return 2
