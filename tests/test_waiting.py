"""``backends.waiting``: every wait returns what Horovod's would, once the handle is done, and a
long wait holds no core; ``backends.stalls``: ranks waiting at different points are named."""
from __future__ import annotations

import json
import threading
import time

import pytest

from hybridsync.backends import stalls, waiting

pytestmark = pytest.mark.unit


class FakeHorovod:
    """A handle that completes after ``polls_until_done`` polls, or at ``done_at`` (``time.perf_counter``);
    ``synchronize`` needs it done."""

    def __init__(self, polls_until_done: int = 0, done_at: float | None = None) -> None:
        self.polls_left = polls_until_done
        self.done_at = done_at
        self.polls = 0

    def poll(self, handle: int) -> bool:
        self.polls += 1
        if self.done_at is not None:
            return time.perf_counter() >= self.done_at
        self.polls_left -= 1
        return self.polls_left < 0

    def synchronize(self, handle: int) -> str:
        assert self.poll(handle), "synchronize called before the handle completed"
        return f"result of {handle}"


@pytest.fixture
def restore_waiting(monkeypatch):
    for name in ("_SLEEPING", "SPIN_S", "MAX_SLEEP_S"):
        monkeypatch.setattr(waiting, name, getattr(waiting, name))  # restored after the test


@pytest.mark.parametrize("sleeping", [False, True])
@pytest.mark.parametrize("polls", [0, 3, 5000])  # done at once, while spinning, after sleeping
def test_wait_returns_the_result_once_done(monkeypatch, restore_waiting, polls, sleeping):
    monkeypatch.setattr(waiting, "_SLEEPING", sleeping)
    monkeypatch.setattr(waiting, "SPIN_S", 1e-4)
    assert waiting.wait(FakeHorovod(polls), 7) == "result of 7"


def test_a_long_wait_holds_no_core_even_in_spin_mode(restore_waiting):
    """Horovod's own wait spins until the handle completes: ~100% of a core for all 3 s here.
    Spin mode spins for its first second only (as Horovod does); the 2 s after it must cost
    less than 10% of a core."""
    waiting.SPIN_S = waiting.SPIN_S_SPINNING
    hvd = FakeHorovod(done_at=time.perf_counter() + 3.0)
    cpu = time.thread_time()
    assert waiting.wait(hvd, 3) == "result of 3"
    used = time.thread_time() - cpu
    assert used < waiting.SPIN_S_SPINNING + 0.2, f"the waiting thread used {used:.2f} CPU-s over a 3 s wait"


def test_a_wait_within_a_step_in_spin_mode_never_sleeps(monkeypatch, restore_waiting):
    """A step's waits (a 300 ms one here) stay Horovod's own: yield and poll, no sleep's wake-up."""
    waiting.SPIN_S = waiting.SPIN_S_SPINNING
    slept = []
    monkeypatch.setattr(waiting.time, "sleep", slept.append)
    assert waiting.wait(FakeHorovod(done_at=time.perf_counter() + 0.3), 1) == "result of 1"
    assert slept == []


def test_work_on_threads_of_its_own_is_waited_for_without_spinning(monkeypatch, restore_waiting):
    """Gloo's work (the hierarchical route's groups): its own blocking wait held no core."""
    waiting.SPIN_S = waiting.SPIN_S_SPINNING
    yields = []
    monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))
    hvd = FakeHorovod(done_at=time.perf_counter() + 0.05)
    waiting.wait_until(lambda: hvd.poll(0), spin=False)
    assert yields == []


def test_wait_mode_comes_from_the_environment(monkeypatch):
    for value, sleeping in (("", False), ("spin", False), ("sleep", True), (" SLEEP ", True)):
        monkeypatch.setenv(waiting.WAIT_VAR, value)
        assert waiting._sleeping() is sleeping
    monkeypatch.setenv(waiting.WAIT_VAR, "busy")
    with pytest.raises(ValueError, match="HYBRIDSYNC_WAIT must be 'spin' or 'sleep'"):
        waiting._sleeping()


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_every_seconds_variable_refuses_what_is_not_seconds_and_names_itself(monkeypatch, value):
    """The stall watch, the PS ping and recovery timeouts, the trial settle wait and the store's
    test hold all read seconds through ``envvars.seconds_from_env``: one rule, one message."""
    from hybridsync import envvars
    from hybridsync.backends.ps import client, recovery
    readers = {envvars.STALL_CHECK_S: stalls.stable_seconds,
               envvars.PS_PING_TIMEOUT: lambda: client._ping_timeout(None),
               envvars.PS_RECOVERY_TIMEOUT: recovery._recovery_timeout_from_env}
    for name, read in readers.items():
        monkeypatch.setenv(name, " 2.5 ")
        assert read() == 2.5
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name} must be a number of seconds >= 0, got '{value}'"):
            read()
        monkeypatch.delenv(name)
    assert (stalls.stable_seconds(), client._ping_timeout(None), recovery._recovery_timeout_from_env()) == \
        (stalls.DEFAULT_STABLE_S, client.DEFAULT_PING_TIMEOUT_S, None)


@pytest.mark.parametrize("value, sleeping", [(None, True), ("sleep", True), ("spin", False)])
def test_tensorflow_jobs_wait_without_spinning_unless_told_to_spin(monkeypatch, restore_waiting, value, sleeping):
    if value is None:
        monkeypatch.delenv(waiting.WAIT_VAR, raising=False)
    else:
        monkeypatch.setenv(waiting.WAIT_VAR, value)
    waiting.wait_like_callbacks()
    assert waiting._SLEEPING is sleeping
    assert waiting.SPIN_S == (0.0 if sleeping else waiting.SPIN_S_SPINNING)
    assert waiting.MAX_SLEEP_S == waiting.CALLBACK_MAX_SLEEP_S
    if sleeping:  # no spin phase: the core is never polled for with sched_yield
        yields = []
        monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))
        assert waiting.wait(FakeHorovod(polls_until_done=3), 7) == "result of 7"
        assert yields == []


# --- the stall watch, on an in-memory board -----------------------------------------------------------------

@pytest.fixture(autouse=True)
def no_wait_for_acknowledgements(monkeypatch):
    """The simulated ranks below check one after the other: none would ever see the others' acks."""
    monkeypatch.setattr(stalls, "ACK_WAIT_S", 0.0)


class FakeStore:
    """The few ``TCPStore`` methods the board uses, over a dict."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()

    def multi_set(self, keys, values):
        for key, value in zip(keys, values):
            self.set(key, value)

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def multi_get(self, keys):
        return [self.data[key] for key in keys]

    def compare_set(self, key, expected, desired):
        with self.lock:
            if self.data[key] == expected.encode():
                self.data[key] = desired.encode()
            return self.data[key]


def watches(size: int) -> tuple[FakeStore, list[stalls._Watch]]:
    store = FakeStore()
    store.multi_set([stalls._VERDICT_KEY, *(stalls._rank_key(r) for r in range(size))], [""] * (size + 1))
    out = []
    for rank in range(size):
        watch = stalls._Watch()
        watch.board = stalls._Board(store, rank, size)
        out.append(watch)
    return store, out


def waits(positions: list[tuple], ws: list[stalls._Watch]) -> list[stalls.LongWait]:
    """Rank r's wait at ``positions[r]``."""
    out = []
    for position, watch in zip(positions, ws):
        stalls.where = position
        out.append(stalls.LongWait(0.0, watch))
    stalls.where = None
    return out


def check_all(ws: list[stalls._Watch], long_waits: list[stalls.LongWait], now: float) -> list[str]:
    """Each rank checks once; returns what each raised (``""``: nothing)."""
    raised = []
    for watch, wait in zip(ws, long_waits):
        try:
            watch.check(wait, now)
            raised.append("")
        except stalls.RanksOutOfStepError as e:
            raised.append(str(e))
    return raised


def test_ranks_waiting_at_different_points_fail_once_the_points_hold(monkeypatch):
    monkeypatch.setenv("HYBRIDSYNC_STALL_CHECK_S", "3")
    _, ws = watches(3)
    long_waits = waits([("set_strategy", 0), ("step", 0, 4, "fc.weight"), ("set_strategy", 0)], ws)
    assert check_all(ws, long_waits, 10.0) == ["", "", ""]  # first sight: not yet known to hold
    assert check_all(ws, long_waits, 12.9) == ["", "", ""]
    assert any(check_all(ws, long_waits, 13.1))  # the first rank to have seen it hold for 3 s
    raised = check_all(ws, long_waits, 13.6)
    assert raised[0] and raised == [raised[0]] * 3, raised  # one verdict, on every rank
    assert "ranks 0, 2 are in set_strategy() (replacing plan opt0)" in raised[0]
    assert "rank 1 is in step 4 of plan opt0, waiting for message 'fc.weight'" in raised[0]
    assert "Every rank must call set_strategy() between the same two steps" in raised[0]


def test_ranks_waiting_in_one_step_are_left_alone(monkeypatch):
    """Different messages of one step: a slow transfer (or a slow server), never a disagreement."""
    monkeypatch.setenv("HYBRIDSYNC_STALL_CHECK_S", "3")
    _, ws = watches(2)
    long_waits = waits([("step", 1, 7, "a"), ("step", 1, 7, "b")], ws)
    for now in (0.0, 5.0, 50.0):
        assert check_all(ws, long_waits, now) == ["", ""]


def test_no_verdict_while_a_rank_is_elsewhere_or_the_points_move(monkeypatch):
    monkeypatch.setenv("HYBRIDSYNC_STALL_CHECK_S", "3")
    _, ws = watches(2)
    first = waits([("step", 0, 4, "x")], ws)[0]
    for now in (0.0, 5.0, 10.0):  # rank 1 computes (not waiting): it may come back
        assert check_all(ws[:1], [first], now) == [""]
    moving = waits([None, ("step", 0, 5, "x")], ws)[1]
    assert check_all(ws, [first, moving], 11.0) == ["", ""]
    moving.close()  # rank 1's wait ended; it waits again, elsewhere
    again = waits([None, ("step", 0, 6, "x")], ws)[1]
    assert check_all(ws, [first, again], 13.5) == ["", ""]  # changed: the clock restarts
    assert check_all(ws, [first, again], 16.0) == ["", ""]
    assert any("rank 1 went on past step 4 without sending message 'x'" in raised
               for raised in check_all(ws, [first, again], 16.6))


def test_the_watch_is_off_with_zero(monkeypatch):
    monkeypatch.setenv("HYBRIDSYNC_STALL_CHECK_S", "0")
    store, ws = watches(2)
    long_waits = waits([("build", 0), ("build", 1)], ws)
    for now in (0.0, 10.0, 20.0):
        assert check_all(ws, long_waits, now) == ["", ""]
    assert json.loads(store.data[stalls._rank_key(0)] or b"0") == 0  # nothing published


def test_a_wait_that_does_not_say_where_it_is_is_never_published(monkeypatch):
    monkeypatch.setenv("HYBRIDSYNC_STALL_CHECK_S", "1")
    store, ws = watches(2)
    long_waits = waits([None, ("step", 0, 1, "x")], ws)
    for now in (0.0, 5.0):
        assert check_all(ws, long_waits, now) == ["", ""]
    assert store.data[stalls._rank_key(0)] == b""
