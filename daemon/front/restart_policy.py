"""When a worker that died is started again, and when the daemon stops trying.

One policy per worker role, like circus's flapping rule: deaths are counted in
a sliding window, each followed by a restart after a growing backoff, until
``max_deaths`` fall within ``window_seconds``; then the policy gives up and its
``give_up`` action runs (for the target, the daemon fails; for the drafter,
drafting is switched off and plain decoding goes on). A worker that is busy but
silent for longer than ``hung_after_seconds`` is hung: the daemon kills it,
and that death counts like any other. Pure logic: the daemon passes the time in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

BACKOFF_SECONDS = (1, 2, 4, 8, 16, 30)


@dataclass
class RestartPolicy:
    max_deaths: int  # this many deaths within window_seconds: give up
    window_seconds: float
    hung_after_seconds: float  # busy and silent this long: hung (the daemon's worker_timeout)
    give_up: Callable[[str, str], None] = lambda reason, how: None  # (why it gave up, how the worker died last)
    backoff_seconds: tuple[float, ...] = BACKOFF_SECONDS
    deaths: list[float] = field(default_factory=list)  # when, within the window
    restarts: int = 0  # restarts scheduled so far
    restart_due: Optional[float] = None
    heard_at: float = 0.0  # the worker's last sign of life
    hung: str = ""  # why it was killed as hung, until its death is handled

    def died(self, now: float) -> Optional[float]:
        """Count a death: the seconds until the restart, or None when this death
        gives up (the caller then runs ``give_up``)."""
        self.deaths = [t for t in self.deaths if now - t < self.window_seconds] + [now]
        if len(self.deaths) >= self.max_deaths:
            self.restart_due = None
            return None
        delay = self.backoff_seconds[min(len(self.deaths) - 1, len(self.backoff_seconds) - 1)]
        self.restarts += 1
        self.restart_due = now + delay
        return delay

    def reason(self) -> str:
        """Why it gave up, to finish a sentence about the worker: "died 3 times within 10 minutes"."""
        return f"died {len(self.deaths)} times within {self.window_seconds / 60:.0f} minutes"

    def due(self, now: float) -> bool:
        """True once, when the scheduled restart is due."""
        if self.restart_due is not None and now >= self.restart_due:
            self.restart_due = None
            return True
        return False

    def start_failed(self, now: float) -> None:
        """No process could be started (out of memory, of pids): try again after the longest backoff."""
        self.restart_due = now + self.backoff_seconds[-1]

    def cancel(self) -> None:
        """No restart (the role was switched off)."""
        self.restart_due = None

    def forgive(self) -> None:
        """The worker did its job (a request finished): earlier deaths no longer count."""
        self.deaths.clear()

    def heard(self, now: float) -> None:
        self.heard_at = now

    def silent_too_long(self, now: float) -> bool:
        return now - self.heard_at > self.hung_after_seconds

    def killed_as_hung(self, why: str) -> None:
        self.hung = why

    def cause(self, exit_code: Optional[int]) -> str:
        """How the worker ended, for the log and for the request it was serving."""
        how, self.hung = self.hung or f"died (exit code {exit_code})", ""
        return how
