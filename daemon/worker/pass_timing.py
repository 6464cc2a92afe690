"""Idle time: the target's passes timed again, into the governors' pass costs.

``PassTimer.refresh`` is what ``Engine.refresh_pass_costs`` runs between
requests (the target worker's loop calls it while nothing waits): it keeps the
cost of every width the governors predict with current, relative to the plain
passes timed beside it (``PassCosts.observe_shape``).
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from ..drafting.governor import MIN_SECONDS, PassCosts
from ..drafting.interfaces import DecodeAborted, Model

log = logging.getLogger("tandem.engine")

# idle time: the target's passes re-measured at most this often (PassTimer.refresh)
REFRESH_SECONDS = 30.0
# a width re-measured in idle time counts when the plain passes before and after it differ by at most this share
# (what another process starting or stopping does to a 2-thread pass: 2-8x; what a quiet machine's noise does: < 20%)
REFRESH_STEADY = 0.5


class PassTimer:
    """Times ``model``'s passes in idle time, on ``clock``."""

    def __init__(self, model: Model, clock: Callable[[], float]):
        self.model = model
        self.clock = clock
        self.refreshed_at: Optional[float] = None  # the last idle re-measurement of the passes

    def refresh(
        self, costs: Optional[PassCosts], interrupted: Callable[[], bool], busy: Callable[[], bool] = lambda: False
    ) -> int:
        """Idle time, at most every REFRESH_SECONDS: time one target pass of each
        width the governors predict with (wider than a plain round's, up to k+1
        tokens: the tokens the model last read, again) at the end of what its KV
        cache holds, each between two passes as wide as a plain round's, drop them
        again, and add what each cost relative to the plain passes beside it to
        the pass costs' shape (PassCosts). Rounds keep the widths they run
        current; a width no round runs (a lookup governor that predicts no gain
        never verifies) would otherwise keep its load-time cost for the daemon's
        life, and one start measured a 2-token pass at 2.5 one-token passes where
        the next measured 1.6. Relative, because idle for this daemon is not idle
        for the machine: what another process runs meanwhile slows every pass
        alike, and a width whose two plain passes differ by more than
        REFRESH_STEADY is not counted (the machine changed while it was timed).
        Nor does it start while other processes keep the machine busy (``busy``:
        the passes it would time are not this machine's usual ones then, and they
        would slow that work; the idle time after the next request tries again).
        Not for a recurrent or hybrid model (its cache cannot drop a tail).
        Stops at a message (``interrupted``); returns the widths measured."""
        model = self.model
        history = getattr(model, "history", None)
        now = self.clock()
        if (
            costs is None
            or history is None
            or not getattr(model, "drops_one_position", True)
            or (self.refreshed_at is not None and now - self.refreshed_at < REFRESH_SECONDS)
        ):
            return 0
        plain = costs.plain_width
        widths = [w for w in sorted(costs.load) if w > plain]
        n_past = model.n_past
        if not widths or n_past < max(widths) or n_past + max(widths) > model.n_ctx or -1 in history[-max(widths) :]:
            return 0
        if interrupted() or busy() or interrupted():  # (a request waits, or came while busy() sampled)
            return 0
        previous, self.refreshed_at = self.refreshed_at, now

        measured: dict[int, float] = {}
        stopped = False
        try:
            stopped = self._time(plain, widths, history, n_past, interrupted, measured)
        except DecodeAborted:  # a request came between a wide pass's calls: what is measured stands
            stopped = True
            model.truncate(n_past)
        except Exception as exc:  # (DecodeError: e.g. a cache that cannot drop a tail) never again, then
            log.warning("re-measuring the target's passes failed (%s: %s); not tried again", type(exc).__name__, exc)
            self.refreshed_at = float("inf")
            return 0
        if not measured:
            if stopped:  # a request came before a width was timed: the next idle time tries again
                self.refreshed_at = previous
            else:
                log.info(
                    "target passes not re-measured: the %d-token passes around them differed by more than %d%% "
                    "(another process started or stopped); tried again after a request, %.0f s on at the earliest",
                    plain,
                    REFRESH_STEADY * 100,
                    REFRESH_SECONDS,
                )
            return 0
        for w, ratio in measured.items():
            costs.observe_shape(w, ratio)
        log.info(
            "target passes re-measured in idle time: %s %d-token passes; a round spends %.1f ms outside its pass",
            ", ".join(f"{w} tok {ratio:.2f}" for w, ratio in measured.items()),
            plain,
            costs.outside() * 1000,
        )
        return len(measured)

    def _time(
        self,
        plain: int,
        widths: list[int],
        history: list[int],
        n_past: int,
        interrupted: Callable[[], bool],
        measured: dict[int, float],
    ) -> bool:
        """Time a pass over the last w of the ``n_past`` tokens the KV cache holds
        (``history``) for each of ``widths``, each between two passes of ``plain``
        tokens, and drop it again; into ``measured``, by width, what it cost
        relative to the plain passes beside it (where they are steady). Returns
        whether ``interrupted`` stopped it."""
        model = self.model

        def timed(w: int) -> float:
            started = self.clock()
            model.decode(list(history[n_past - w : n_past]), logits_for=range(w), abort=interrupted)
            seconds = self.clock() - started
            model.truncate(n_past)
            return seconds

        # untimed: after idle time the first passes run slower (the plain width's and the batched kernels)
        timed(plain)
        timed(widths[0])
        reference = timed(plain)
        for w in widths:
            if interrupted():
                return True
            seconds = timed(w)
            after = timed(plain)
            if abs(after - reference) <= REFRESH_STEADY * min(after, reference):
                measured[w] = seconds / max((reference + after) / 2, MIN_SECONDS)
            reference = after
        return False
