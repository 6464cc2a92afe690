"""``tandem cache clear``: empty the daemon's prefix cache, in shared memory and on disk
(or, with no daemon running, remove the disk tier's page files)."""

from __future__ import annotations

from tandem.client import Client, DaemonNotRunning

from .common import mib, say


def add_cache(sub) -> None:
    p = sub.add_parser("cache", help="the prefix cache: clear it", description="Manage the daemon's prefix cache.")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    c = csub.add_parser(
        "clear",
        help="drop every cached page, in shared memory and on disk (after the running request, before the next "
        "queued one); with no daemon running, remove the disk tier's page files",
    )
    c.add_argument(
        "--memory-only", action="store_true", help="clear the shared memory only: the page files on disk stay"
    )


def cmd_cache(args) -> int:
    if args.cache_command != "clear":
        say("usage: tandem cache clear [--memory-only]")
        return 2
    try:
        with Client(args.socket) as client:
            reply = client.cache_clear(memory_only=args.memory_only)
    except DaemonNotRunning:
        return _clear_without_daemon(args)
    on_disk = f" and {reply.disk_pages:,} ({mib(reply.disk_bytes)}) from disk" if not args.memory_only else ""
    if reply.cache is None:
        say("this daemon has no prefix cache (it was started with --cache-bytes 0)")
        if reply.disk_pages:
            print(f"removed {reply.disk_pages:,} page files ({mib(reply.disk_bytes)}) of earlier daemons from disk")
        return 0
    disk = reply.cache.disk
    print(
        f"cleared {reply.pages:,} pages ({mib(reply.bytes)}) from shared memory"
        + on_disk
        + f"; the cache now holds {reply.cache.pages:,} pages"
        + (f" in memory, {disk.pages:,} on disk ({disk.path})" if disk is not None else "")
    )
    return 0


def _clear_without_daemon(args) -> int:
    if args.memory_only:
        print("no daemon is running: shared memory holds no pages")
        return 0
    from tandem.daemon.cache.disk_cache import clear_dir, default_dir

    root = args.settings.values.disk_cache_dir or default_dir()
    pages, nbytes, held = clear_dir(root)
    print(f"no daemon is running; removed {pages:,} page files ({mib(nbytes)}) from {root}")
    if held:
        say(f"left {held} model(s)' pages that a running daemon holds (clear them through its socket)")
    return 0
