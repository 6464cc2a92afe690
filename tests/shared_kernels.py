"""tandem's CPU kernels for tests whose daemons have a model store of their own."""

from __future__ import annotations

from pathlib import Path


def share_kernels(cache_home: Path) -> None:
    """A test's own XDG_CACHE_HOME (its model store) sees the session's built CPU kernels, so that its
    daemons run what every other test daemon runs, and neither download nor build them again."""
    from tandem.daemon import kernels

    link = cache_home / "tandem" / "kernels"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(kernels.cache_root(), target_is_directory=True)
