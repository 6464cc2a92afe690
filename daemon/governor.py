"""The governor: draft only while drafting is measurably faster than plain decoding.

On a 2-core laptop a verify pass over k+1 tokens costs 2-3 one-token passes, so
a model drafter is usually slower than plain decoding; the governor decides,
round by round, whether to draft, from what this machine actually does.

**Measuring.** Every round is timed from before the drafter is asked to after
the target's rollback (drafting rounds) or around the one-token step (plain
rounds). Each kind has a ``MovingRate``: moving averages of tokens per round
and of seconds per round, whose ratio is the rate in tokens/s. An update has
weight ``max(1/window, 1/n)``, n = rounds since the average was last
restarted: the exact mean of the rounds since the restart until there are
``window`` (16) of them, then exponential with a time constant of ``window``
rounds. A probe restarts the drafting average and a refresh restarts the plain
one: what they measure replaces an estimate that is tens of rounds old. A
drafting round in which the drafter had nothing to propose (an n-gram drafter
without a match) counts as a drafting round: it is what drafting mode does.

**Phases.** ``measuring`` (2 plain rounds; a new governor measures plain
decoding first) -> ``drafting``. In ``drafting``, once the drafting average has
2 rounds, drafting goes on while it is at least ``threshold`` (1.02) times the
plain rate, else -> ``plain``; after every 64 drafting rounds ->
``refreshing`` (2 plain rounds), then back to ``drafting`` if drafting still
wins, else ``plain``. In ``plain``, after ``interval`` plain rounds (32 at
first) -> ``probing`` (2 drafting rounds): a success returns to ``drafting``
and resets the interval to 32; a failure doubles it (up to 512) and waits
again. Turning drafting off from ``drafting`` waits the current interval
without doubling it: only failed probes double.

**Catching up.** Before a probe, a model drafter must first read what the
target decoded while it was idle (and, if the request began in ``plain``, the
prompt): on 2 cores that costs as much as the drafter's share of a prefill. It is
not timed as drafting (it is paid once per switch, not per round), but it is
not free either: its time becomes a debt that plain rounds pay off at
``catch_up_share`` (1%), and the next probe waits until the debt is paid as
well as the interval. With a short context this never delays anything; with a
long one it keeps catching up under 1% of the time.

A ``GovernorBank`` keeps one governor per task (see ``task_key``) and persists
them; ``Engine`` drives them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from tandem.protocol import GovernorInfo

log = logging.getLogger("tandem.governor")

STATE_VERSION = 1

MEASURING = "measuring"
DRAFTING = "drafting"
REFRESHING = "refreshing"
PLAIN = "plain"
PROBING = "probing"
PHASES = (MEASURING, DRAFTING, REFRESHING, PLAIN, PROBING)
DRAFTING_PHASES = (DRAFTING, PROBING)


@dataclass(frozen=True)
class GovernorParams:
    threshold: float = 1.02  # drafting must be at least this many times as fast as plain
    window: int = 16  # rounds: the moving averages' time constant
    measure_rounds: int = 2  # plain rounds when a governor starts and at each refresh
    probe_rounds: int = 2  # drafting rounds of a probe (and the first drafting decision)
    refresh_every: int = 64  # drafting rounds between refreshes of the plain estimate
    first_interval: int = 32  # plain rounds before the first re-probe
    max_interval: int = 512
    catch_up_share: float = 0.01  # at most this share of plain time goes to catching the drafter up for probes


@dataclass
class MovingRate:
    """tokens/s over rounds: the ratio of the moving averages of tokens and of
    seconds per round (a rate of ratios would let one fast round dominate)."""

    window: int
    tokens: float = 0.0
    seconds: float = 0.0
    n: int = 0  # rounds since the last restart

    def add(self, tokens: float, seconds: float) -> None:
        self.n += 1
        w = max(1.0 / self.window, 1.0 / self.n)
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)

    def restart(self) -> None:
        """The next round replaces the estimate (which is reported until then)."""
        self.n = 0

    @property
    def rate(self) -> Optional[float]:
        return self.tokens / self.seconds if self.seconds > 0 else None


@dataclass
class Governor:
    params: GovernorParams = field(default_factory=GovernorParams)
    clock: Callable[[], float] = time.perf_counter
    phase: str = MEASURING
    left: int = -1  # rounds left in measuring / refreshing / probing
    countdown: int = 0  # plain rounds until the next probe
    interval: int = -1
    since_refresh: int = 0  # drafting rounds since the plain estimate was refreshed
    plain_rounds: int = 0
    draft_rounds: int = 0
    probes: int = 0
    failed_probes: int = 0
    debt: float = 0.0  # seconds of plain rounds still to run before the next probe (catch-up costs)
    plain: MovingRate = field(init=False)
    draft: MovingRate = field(init=False)
    _started: Optional[float] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain = MovingRate(p.window)
        self.draft = MovingRate(p.window)
        if self.left < 0:
            self.left = p.measure_rounds
        if self.interval < 0:
            self.interval = p.first_interval

    # ---- the engine's side

    @property
    def drafting(self) -> bool:
        """Whether the next round drafts."""
        return self.phase in DRAFTING_PHASES

    def start_round(self) -> None:
        self._started = self.clock()

    def end_round(self, tokens: int) -> None:
        """The round started by ``start_round`` produced ``tokens``."""
        assert self._started is not None, "end_round without start_round"
        seconds = self.clock() - self._started
        self._started = None
        self.record(tokens, seconds)

    def caught_up(self, seconds: float) -> None:
        """The drafter took ``seconds`` to catch up before a probe."""
        self.debt += seconds / self.params.catch_up_share

    def skip_round(self) -> None:
        """The round started did not run as asked (no room left to draft): not counted."""
        self._started = None

    # ---- the state machine

    def record(self, tokens: int, seconds: float) -> None:
        """Account one round of the kind the current phase asked for."""
        p = self.params
        if self.drafting:
            self.draft.add(tokens, seconds)
            self.draft_rounds += 1
        else:
            self.plain.add(tokens, seconds)
            self.plain_rounds += 1
            self.debt = self.debt - seconds if self.debt - seconds > 1e-6 else 0.0
        if self.phase == MEASURING:
            self.left -= 1
            if self.left <= 0:
                self._enter_drafting(restart=True)
        elif self.phase == DRAFTING:
            self.since_refresh += 1
            if self.draft.n >= p.probe_rounds and not self.draft_wins():
                self._enter_plain()
            elif self.since_refresh >= p.refresh_every:
                self.phase, self.left = REFRESHING, p.measure_rounds
                self.plain.restart()
        elif self.phase == REFRESHING:
            self.left -= 1
            if self.left <= 0:
                if self.draft_wins():
                    self._enter_drafting(restart=False)
                else:
                    self._enter_plain()
        elif self.phase == PLAIN:
            self.countdown = max(0, self.countdown - 1)
            if self.countdown <= 0 and self.debt <= 0:
                self.phase, self.left = PROBING, p.probe_rounds
                self.probes += 1
                self.draft.restart()
        elif self.phase == PROBING:
            self.left -= 1
            if self.left <= 0:
                if self.draft_wins():
                    self.interval = p.first_interval
                    self._enter_drafting(restart=False)
                else:
                    self.failed_probes += 1
                    self.interval = min(2 * self.interval, p.max_interval)
                    self._enter_plain()

    def draft_wins(self) -> bool:
        plain, draft = self.plain.rate, self.draft.rate
        if plain is None:
            return True  # nothing to compare with yet
        return draft is not None and draft >= self.params.threshold * plain

    def _enter_drafting(self, restart: bool) -> None:
        self.phase, self.since_refresh = DRAFTING, 0
        if restart:
            self.draft.restart()

    def _enter_plain(self) -> None:
        self.phase, self.countdown = PLAIN, self.interval

    # ---- reporting and persistence

    def info(self, task: str = "", tasks: int = 1) -> GovernorInfo:
        return GovernorInfo(
            task=task,
            tasks=tasks,
            phase=self.phase,
            drafting=self.drafting,
            plain_tokens_per_second=self.plain.rate,
            draft_tokens_per_second=self.draft.rate,
            probe_interval=self.interval,
            rounds_until_probe=self.countdown if self.phase == PLAIN else 0,
            probe_debt_seconds=self.debt,
            plain_rounds=self.plain_rounds,
            draft_rounds=self.draft_rounds,
            probes=self.probes,
            failed_probes=self.failed_probes,
        )

    def to_dict(self) -> dict:
        return {
            "phase": self.phase,
            "left": self.left,
            "countdown": self.countdown,
            "interval": self.interval,
            "since_refresh": self.since_refresh,
            "plain_rounds": self.plain_rounds,
            "draft_rounds": self.draft_rounds,
            "probes": self.probes,
            "failed_probes": self.failed_probes,
            "debt": self.debt,
            "plain": [self.plain.tokens, self.plain.seconds, self.plain.n],
            "draft": [self.draft.tokens, self.draft.seconds, self.draft.n],
        }

    @classmethod
    def from_dict(cls, d: dict, params: GovernorParams, clock: Callable[[], float]) -> "Governor":
        """Raises ValueError (or KeyError/TypeError) for anything not written by to_dict."""
        if d["phase"] not in PHASES:
            raise ValueError(f"unknown phase {d['phase']!r}")
        ints = (
            "left",
            "countdown",
            "interval",
            "since_refresh",
            "plain_rounds",
            "draft_rounds",
            "probes",
            "failed_probes",
        )
        if not all(type(d[k]) is int and d[k] >= 0 for k in ints):
            raise ValueError("counters must be non-negative integers")
        if not params.first_interval <= d["interval"] <= params.max_interval:
            raise ValueError(f"probe interval {d['interval']} out of range")
        debt = d["debt"]
        if not isinstance(debt, (int, float)) or not 0 <= debt < 1e7:
            raise ValueError("bad probe debt")
        g = cls(params=params, clock=clock, debt=float(debt), **{k: d[k] for k in ("phase", *ints)})
        for name in ("plain", "draft"):
            tokens, seconds, n = d[name]
            if not (isinstance(tokens, (int, float)) and isinstance(seconds, (int, float)) and type(n) is int):
                raise ValueError(f"bad {name} average")
            if not (0 <= tokens < 1e6 and 0 <= seconds < 1e6 and n >= 0):
                raise ValueError(f"{name} average out of range")
            setattr(g, name, MovingRate(params.window, float(tokens), float(seconds), n))
        return g


def task_key(tokens: list[int], n: int = 16) -> str:
    """What the governor keys its state on: the prompt's first ``n`` tokens.

    For chat that is the template's header and the start of the system prompt
    (Qwen and SmolLM2 insert a default one), so an agent or an editor plugin,
    which re-send the same system prompt, keep one state each, while requests
    without a system prompt share one. For a raw prompt it is the prompt's
    start (an editor's file prefix)."""
    head = ",".join(map(str, tokens[:n])).encode()
    return hashlib.sha256(head).hexdigest()[:12]


class GovernorBank:
    """One governor per task, least recently used dropped beyond ``max_tasks``,
    persisted as JSON to ``path`` (written atomically after each request) and
    keyed by ``identity`` (target, drafter, draft length), so a change of model
    starts fresh. A corrupt or foreign file is ignored with a warning."""

    def __init__(
        self,
        identity: str,
        path: Optional[Path] = None,
        params: GovernorParams = GovernorParams(),
        clock: Callable[[], float] = time.perf_counter,
        max_tasks: int = 64,
        per_task: bool = True,
    ):
        self.identity = identity
        self.path = path
        self.params = params
        self.clock = clock
        self.max_tasks = max_tasks
        self.per_task = per_task  # False: one governor for every request
        self.tasks: OrderedDict[str, Governor] = OrderedDict()
        self.last_task = ""
        self.touched: set[str] = set()  # tasks this process served: saved over the file's; the rest kept
        if path is not None:
            self._load(path)

    def get(self, task: str) -> Governor:
        if not self.per_task:
            task = "all"
        g = self.tasks.get(task)
        if g is None:
            g = self.tasks[task] = Governor(self.params, self.clock)
            while len(self.tasks) > self.max_tasks:
                self.tasks.popitem(last=False)
        self.tasks.move_to_end(task)
        self.last_task = task
        self.touched.add(task)
        return g

    def info(self) -> Optional[GovernorInfo]:
        """The state of the most recently used task's governor."""
        g = self.tasks.get(self.last_task)
        return g.info(self.last_task, len(self.tasks)) if g is not None else None

    def save(self) -> None:
        """Write the state atomically. Another daemon may share the file (two
        daemons, one state directory): under a lock, its tasks that this one did
        not serve are read back and kept, so neither clobbers the other's."""
        if self.path is None:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                on_disk = self._read(self.path, quiet=True)
                theirs = OrderedDict(on_disk[0] if on_disk else ())
                # oldest first: what only we still hold but did not serve, then the file's
                # (the other daemon's fresh ones among them), then what we served, by use
                tasks = OrderedDict(
                    (k, g.to_dict()) for k, g in self.tasks.items() if k not in theirs and k not in self.touched
                )
                tasks.update((k, v) for k, v in theirs.items() if k not in self.touched)
                tasks.update((k, g.to_dict()) for k, g in self.tasks.items() if k in self.touched)
                tasks = OrderedDict(list(tasks.items())[-self.max_tasks :])
                doc = {"version": STATE_VERSION, "identity": self.identity, "last_task": self.last_task, "tasks": tasks}
                fd, tmp = tempfile.mkstemp(prefix=".governor-", dir=self.path.parent)
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, self.path)
                tmp = None
        except (OSError, ValueError, TypeError) as exc:  # a full disk, a value JSON cannot write
            log.warning("could not save the governor state to %s: %s", self.path, exc)
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)  # no half-written file left behind

    def _read(self, path: Path, quiet: bool = False) -> Optional[tuple[OrderedDict, object]]:
        """The file's tasks (as written) and last task, if it is a readable state
        of this identity; None otherwise (with a warning unless ``quiet``)."""
        warn = (lambda *a: None) if quiet else log.warning
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            warn("ignoring the governor state in %s: %s", path, exc)
            return None
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
                raise ValueError(f"not a version {STATE_VERSION} governor state")
            if doc.get("identity") != self.identity:
                warn(
                    "ignoring the governor state in %s: it is for %s, not %s", path, doc.get("identity"), self.identity
                )
                return None
            if not isinstance(doc.get("tasks"), dict):
                raise ValueError("'tasks' is not a map")
            for v in doc["tasks"].values():
                Governor.from_dict(v, self.params, self.clock)  # each must load
        except Exception as exc:  # any shape a damaged or hand-edited file has: it must not stop the model loading
            warn("ignoring the governor state in %s (%s: %s); starting fresh", path, type(exc).__name__, exc)
            return None
        return OrderedDict((str(k), v) for k, v in doc["tasks"].items()), doc.get("last_task")

    def _load(self, path: Path) -> None:
        read = self._read(path)
        if read is None:
            return
        raw, last = read
        tasks = OrderedDict((k, Governor.from_dict(v, self.params, self.clock)) for k, v in raw.items())
        self.tasks = OrderedDict(list(tasks.items())[-self.max_tasks :])
        self.last_task = last if isinstance(last, str) and last in self.tasks else ""
        log.info("governor: %d task(s) restored from %s", len(self.tasks), path)


def state_file(state_dir: Path, identity: str) -> Path:
    """One file per (target, drafter, draft length): switching models and back keeps both."""
    return state_dir / f"governor-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"
