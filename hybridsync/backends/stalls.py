"""Ranks that wait for each other at different points of the program: found, named, failed.

A collective completes only when every rank starts it. When ranks disagree about the
program (one skipped ``step()``, one does not call ``set_strategy()``, one froze a parameter
after the optimizer was built), each waits for a collective the others never start, and
Horovod waits forever. Here, a rank whose wait has lasted ``WATCH_AFTER_S`` says where it
waits on a small board every rank reaches outside Horovod (a ``TCPStore`` that rank 0 hosts,
offered when the first optimizer is built: ``hybridsync.agreement``) and reads where the
others wait. When every rank is waiting, each at a point that has not changed for
``HYBRIDSYNC_STALL_CHECK_S`` seconds, and the points are not one round of one collective
piece of work (the same step of the same plan, the same strategy comparison), none of them
can ever go on: the first rank to see it writes a verdict, and every rank raises
``RanksOutOfStepError`` with it, naming where each rank waits.

A healthy job never fails here: ranks waiting at the same point (a slow transfer, a slow
server) are left alone, and so are waits while some rank is elsewhere (computing,
evaluating, writing a checkpoint: it may come back). Waits that do not say where they are
(``where`` is ``None``) are never published.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import time
import warnings
from typing import Any

from hybridsync import envvars

WATCH_AFTER_S = 2.0
"""A wait is published once it lasted this long: shorter ones are a step's ordinary waits."""
CHECK_EVERY_S = 0.5
STORE_TIMEOUT = datetime.timedelta(seconds=10)
"""Bound on one board operation; a board that does not answer (rank 0 gone) is given up."""
DEFAULT_STABLE_S = 3.0

where: tuple | None = None
"""Where this rank waits now, set by the code that waits (``Router.finish``, ``agreement``):
``("build", plan)`` while optimizers compare strategies at construction, ``("set_strategy",
plan)``, ``("step", plan, step, message)`` (``message`` ``None``: the agreement on sparse
gradients; ``("step", plan, step, None, "order")``: the agreement on the order of hierarchical
messages); ``plan`` is the router number (``opt<N>``), ``step`` its ``finish()`` count."""

AGREEMENTS = {"kinds": "the agreement on which gradients are sparse",
              "order": "the agreement on the order of hierarchical messages"}
"""What the ranks agree on in a step (``where``'s fifth element, default ``kinds``), as errors name it."""


class RanksOutOfStepError(RuntimeError):
    """Ranks wait for each other at different points of the program and none can go on."""


def stable_seconds() -> float:
    """``HYBRIDSYNC_STALL_CHECK_S`` (default ``DEFAULT_STABLE_S``; 0 turns the watch off)."""
    return envvars.seconds_from_env(envvars.STALL_CHECK_S, DEFAULT_STABLE_S)


@dataclasses.dataclass
class _Board:
    store: Any
    rank: int
    size: int

    def keys(self) -> list[str]:
        return [_rank_key(r) for r in range(self.size)]

    def publish(self, text: str) -> None:
        self.store.set(_rank_key(self.rank), text)

    def read(self) -> tuple[str, list[str]]:
        """The verdict (``""``: none yet) and every rank's entry (``""``: not waiting)."""
        values = self.store.multi_get([_VERDICT_KEY, *self.keys()])
        verdict, *entries = (v.decode() for v in values)
        return verdict, entries

    def decide(self, verdict: str) -> str:
        """Write ``verdict`` unless another rank wrote one first; the one that stands."""
        return self.store.compare_set(_VERDICT_KEY, "", verdict).decode()


_VERDICT_KEY = "hybridsync/stall/verdict"
_SEEN = "seen"
"""A rank's entry once it read the verdict."""
ACK_WAIT_S = 3.0


def _rank_key(rank: int) -> str:
    return f"hybridsync/stall/rank{rank}"


class _Watch:
    """This process's side of the board: how to reach it, and what it saw last."""

    def __init__(self) -> None:
        self.board: _Board | None = None
        self.offer: tuple[list[str], int] | None = None
        self.rank = self.size = 0
        self.serial = 0
        self.snapshot: list[str] | None = None
        self.since = 0.0
        self.failed = False

    def host(self, rank: int, size: int) -> tuple[list[str], int] | None:
        """Rank 0: start the board (once per job); the offer for the other ranks, or ``None``."""
        from hybridsync.backends import rendezvous
        try:
            store, offer = rendezvous.host_store(STORE_TIMEOUT)
            store.multi_set([_VERDICT_KEY, *(_rank_key(r) for r in range(size))], [""] * (size + 1))
        except (ValueError, RuntimeError, OSError) as e:
            warnings.warn(f"hybridsync: no stall watch for this job ({e})", RuntimeWarning, stacklevel=2)
            return None
        self.board, self.rank, self.size = _Board(store, rank, size), rank, size
        return offer

    def accept(self, offer: tuple[list[str], int] | None, rank: int, size: int) -> None:
        """Other ranks: remember rank 0's offer; the board is reached at the first long wait."""
        if self.board is None and self.offer is None and offer is not None:
            self.offer, self.rank, self.size = offer, rank, size

    @property
    def ready(self) -> bool:
        """Whether this job has (or was offered) a board."""
        return self.board is not None or self.offer is not None

    def _reach(self) -> _Board | None:
        if self.board is None and self.offer is not None and not self.failed:
            from hybridsync.backends import rendezvous
            candidates, port = self.offer
            reached = rendezvous.reach(candidates, port)
            if reached is None:
                self._give_up(f"rank 0 is not reachable at {', '.join(candidates)} port {port}")
            else:
                self.board = _Board(rendezvous.connect_store(reached[0], port, STORE_TIMEOUT), self.rank, self.size)
        return None if self.failed else self.board

    def _give_up(self, why: str) -> None:
        self.failed = True
        warnings.warn(f"hybridsync: the stall watch stops on this rank ({why})", RuntimeWarning, stacklevel=3)

    def check(self, wait: LongWait, now: float) -> None:
        """Publish where ``wait`` is; raise ``RanksOutOfStepError`` if the ranks are out of step."""
        stable_s = stable_seconds()
        if wait.where is None or stable_s == 0:
            return
        try:
            board = self._reach()
            if board is None:
                return
            if not wait.published:
                board.publish(json.dumps([wait.serial, wait.where]))
                wait.published = True
            verdict, entries = board.read()
            if not verdict:
                verdict = self._judge(board, entries, now, stable_s)
        except (RuntimeError, OSError, ValueError) as e:  # the store failed: rank 0 is gone or stuck
            self._give_up(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return
        if verdict:
            self._acknowledge(board)
            raise RanksOutOfStepError(verdict)

    def _acknowledge(self, board: _Board) -> None:
        """Say this rank read the verdict, and wait (at most ``ACK_WAIT_S``) until every rank did:
        the first rank to raise may end the job, and rank 0's board with it, before a slower
        rank's next look (which would then see only Horovod's own shutdown error)."""
        deadline = time.monotonic() + ACK_WAIT_S
        try:
            board.publish(_SEEN)
            while not all(entry == _SEEN for entry in board.read()[1]) and time.monotonic() < deadline:
                time.sleep(0.05)
        except (RuntimeError, OSError, ValueError):
            pass  # the board is gone: every rank that could read the verdict has

    def _judge(self, board: _Board, entries: list[str], now: float, stable_s: float) -> str:
        """The verdict once every rank waits at a point unchanged for ``stable_s``, and the points
        differ; ``""`` while that is not (yet) so."""
        if not all(entries):
            self.snapshot = None
            return ""
        if entries != self.snapshot:
            self.snapshot, self.since = entries, now
            return ""
        positions = [tuple(json.loads(e)[1]) for e in entries]
        if now - self.since < stable_s or len({_round(p) for p in positions}) == 1:
            return ""
        return board.decide(describe(positions, now - self.since))

    def withdraw(self) -> None:
        """This rank's wait ended: it no longer waits where it said."""
        if self.board is not None and not self.failed:
            try:
                self.board.publish("")
            except (RuntimeError, OSError) as e:
                self._give_up(str(e))


_watch = _Watch()


class LongWait:
    """One wait that has lasted: ``tick`` at its polls, ``close`` when it ends."""

    def __init__(self, start: float, watch: _Watch | None = None) -> None:
        self._watch = watch or _watch
        self._watch.serial += 1
        self.serial = self._watch.serial
        self.where = where
        self.published = False
        self._next = start + WATCH_AFTER_S

    def tick(self, now: float) -> None:
        if now >= self._next and self._watch.ready:
            self._next = now + CHECK_EVERY_S
            self._watch.check(self, now)

    def close(self) -> None:
        if self.published:
            self._watch.withdraw()


class Watched:
    """A wait loop of its own (``with Watched() as watch``): ``watch.tick()`` at each poll; the
    wait is published once it lasted ``WATCH_AFTER_S``."""

    def __init__(self, start: float | None = None) -> None:
        """``start``: when the wait began (``time.perf_counter()``; default: now)."""
        self.start = time.perf_counter() if start is None else start
        self._wait: LongWait | None = None

    def __enter__(self) -> Watched:
        return self

    def tick(self) -> None:
        now = time.perf_counter()
        if now - self.start >= WATCH_AFTER_S:
            if self._wait is None:
                self._wait = LongWait(self.start)
            self._wait.tick(now)

    def __exit__(self, *exc_info: object) -> None:
        if self._wait is not None:
            self._wait.close()


def verdict() -> str:
    """The verdict on this job's board, if any (``""``: none, or no board reachable). For a rank
    whose wait failed because another rank left after the verdict (Horovod shut down)."""
    board = _watch.board if not _watch.failed else None
    if board is None:
        return ""
    try:
        return board.read()[0]
    except (RuntimeError, OSError, ValueError):
        return ""


def host_board(rank: int, size: int) -> tuple[list[str], int] | None:
    """Rank 0, at every optimizer construction and ``set_strategy``: start the board unless this
    job has one; returns the offer to pass on (``None``: nothing new to offer)."""
    _forget_another_world(rank, size)
    return None if _watch.ready else _watch.host(rank, size)


def accept_board(offer: Any, rank: int, size: int) -> None:
    """Every other rank: the offer rank 0 passed on (``None``: nothing new)."""
    _forget_another_world(rank, size)
    if offer is not None:
        candidates, port = offer
        _watch.accept((list(candidates), int(port)), rank, size)


def _forget_another_world(rank: int, size: int) -> None:
    """A board set up when this process had another rank or job size (Elastic Horovod reset the
    job since) describes ranks that are gone: drop it, so that rank 0 offers a new one."""
    global _watch
    if _watch.ready and (_watch.rank, _watch.size) != (rank, size):
        _watch = _Watch()


def _round(position: tuple) -> tuple:
    """What ranks waiting together share: the kind and plan, and the step (not the message)."""
    return position[:3]


def describe(positions: list[tuple], stable_s: float) -> str:
    """The verdict: where each rank waits, and what usually causes it."""
    by_place: dict[str, list[int]] = {}
    for rank, position in enumerate(positions):
        by_place.setdefault(_place(position), []).append(rank)
    places = "; ".join(f"{_ranks(ranks)} {place}" for place, ranks in by_place.items())
    return (f"hybridsync: the ranks wait for each other at different points of the program, and none can go "
            f"on (unchanged for {stable_s:.0f} s): {places}. {' '.join(_hints(positions))} "
            f"The job cannot continue.")


def _place(position: tuple) -> str:
    kind, plan = position[0], position[1]
    if kind == "build":
        return f"building a DistributedOptimizer (plan opt{plan}, comparing strategies)"
    if kind == "set_strategy":
        return f"in set_strategy() (replacing plan opt{plan})"
    step, message = position[2], position[3]
    what = AGREEMENTS[position[4] if len(position) > 4 else "kinds"] if message is None else f"message {message!r}"
    return f"in step {step} of plan opt{plan}, waiting for {what}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} are"


def _hints(positions: list[tuple]) -> list[str]:
    kinds = {p[0] for p in positions}
    steps = [p for p in positions if p[0] == "step"]
    hints = []
    if "set_strategy" in kinds and len(kinds) > 1:
        hints.append("Every rank must call set_strategy() between the same two steps.")
    if "build" in kinds and len(kinds) > 1 or len({p[1] for p in positions if p[0] == "build"}) > 1:
        hints.append("Every rank must create the same DistributedOptimizers in the same order.")
    if len({p[1] for p in steps}) > 1:
        hints.append("Ranks step different optimizers: every rank must step them in the same order.")
    elif len({p[2] for p in steps}) > 1:
        behind = min(steps, key=lambda p: p[2])
        ahead = [r for r, p in enumerate(positions) if p[0] == "step" and p[2] > behind[2]]
        what = "" if behind[3] is None else f" without sending message {behind[3]!r}"
        hints.append(f"{_ranks(ahead).rsplit(' ', 1)[0]} went on past step {behind[2]}{what}: a parameter requires "
                     f"a gradient on some ranks only (requires_grad changed since the optimizer was built), a "
                     f"rank skipped optimizer.step() or synchronize(), or ran more backward passes "
                     f"(backward_passes_per_step).")
    return hints
