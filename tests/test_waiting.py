"""``backends.waiting``: the sleeping wait returns what Horovod's would, once the handle is done."""
from __future__ import annotations

import pytest

from hybridsync.backends import waiting

pytestmark = pytest.mark.unit


class FakeHorovod:
    """A handle that completes after ``polls_until_done`` polls; ``synchronize`` needs it done."""

    def __init__(self, polls_until_done: int) -> None:
        self.polls_left = polls_until_done

    def poll(self, handle: int) -> bool:
        self.polls_left -= 1
        return self.polls_left < 0

    def synchronize(self, handle: int) -> str:
        assert self.polls_left < 0, "synchronize called before the handle completed"
        return f"result of {handle}"


@pytest.mark.parametrize("polls", [0, 3, 5000])  # done at once, while spinning, after sleeping
def test_sleeping_wait_returns_the_result_once_done(monkeypatch, polls):
    monkeypatch.setattr(waiting, "_SLEEPING", True)
    monkeypatch.setattr(waiting, "SPIN_S", 1e-4)
    assert waiting.wait(FakeHorovod(polls), 7) == "result of 7"


def test_wait_mode_comes_from_the_environment(monkeypatch):
    for value, sleeping in (("", False), ("spin", False), ("sleep", True), (" SLEEP ", True)):
        monkeypatch.setenv(waiting.WAIT_VAR, value)
        assert waiting._sleeping() is sleeping
    monkeypatch.setenv(waiting.WAIT_VAR, "busy")
    with pytest.raises(ValueError, match="HYBRIDSYNC_WAIT must be 'spin' or 'sleep'"):
        waiting._sleeping()


@pytest.mark.parametrize("value, sleeping", [(None, True), ("sleep", True), ("spin", False)])
def test_tensorflow_jobs_wait_without_spinning_unless_told_to_spin(monkeypatch, value, sleeping):
    for name in ("_SLEEPING", "SPIN_S", "MAX_SLEEP_S"):
        monkeypatch.setattr(waiting, name, getattr(waiting, name))  # restored after the test
    if value is None:
        monkeypatch.delenv(waiting.WAIT_VAR, raising=False)
    else:
        monkeypatch.setenv(waiting.WAIT_VAR, value)
    waiting.wait_like_callbacks()
    assert waiting._SLEEPING is sleeping
    assert (waiting.SPIN_S, waiting.MAX_SLEEP_S) == (0.0, waiting.CALLBACK_MAX_SLEEP_S)
    if sleeping:  # no spin phase: the core is never polled for with sched_yield
        yields = []
        monkeypatch.setattr(waiting.os, "sched_yield", lambda: yields.append(1))
        assert waiting.wait(FakeHorovod(polls_until_done=3), 7) == "result of 7"
        assert yields == []
