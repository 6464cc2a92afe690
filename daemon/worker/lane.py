"""The target worker's side of the short-request lane (daemon/front/scheduler.py's
``Lane`` decides what is short): ``Engine.run_within`` serves a short request
between two steps of a running one, or between two passes of its prompt's
reading (``lending``), from a copy of the running one's KV state that at most
``copy_budget()`` bytes may take."""

from __future__ import annotations

from typing import Callable, Optional

from ..drafting.interfaces import Model
from .request_state import RequestState

COPY_SHARE = 4  # a running request's KV state is copied when it takes at most 1/4 of the available memory


class ResumeFailed(Exception):
    """The short-request lane could not put the running request's KV back."""


def copy_budget() -> int:
    """Bytes the short-request lane may spend on a copy of the running request's KV state."""
    import psutil

    return psutil.virtual_memory().available // COPY_SHARE


def lending(
    state: RequestState,
    check: Callable[[], bool],
    lend: Optional[Callable[[], bool]],
    model: Model,
    clock: Callable[[], float],
) -> Callable[[], bool]:
    """The prefill's check between two passes (``check``: cancelled?), which first
    lends the model to a waiting short request where the model can pause there
    (``pausable``: not while a prompt reader reads the prompt)."""
    pausable = getattr(model, "pausable", None)
    if lend is None or pausable is None:
        return check

    def checked() -> bool:
        paused = clock()
        if pausable() and lend():
            state.paused_reading += clock() - paused
        return check()

    return checked
