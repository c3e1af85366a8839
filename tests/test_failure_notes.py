"""A failed job's last line names the rank whose error ended it (``hybridsync.failure_notes``), not the
first rank to exit, which is usually one that only followed it into Horovod's shutdown."""
from __future__ import annotations

import sys
import time

import pytest

from conftest import BIN, run_job
from hybridsync import envvars, failure_notes
from hybridsync.failure_notes import FailureNote, first_failure, is_follower


class HorovodInternalError(RuntimeError):
    """Named as Horovod's, as ``is_follower`` knows it by name (Horovod is not imported here)."""


@pytest.mark.unit
def test_an_error_that_follows_another_ranks_failure_is_told_from_one_that_causes_it():
    assert is_follower(HorovodInternalError("Horovod has been shut down. This was caused by ..."))
    assert is_follower(RuntimeError("Horovod has been shut down. This was caused by an exception on one of the ranks"))
    try:
        try:
            raise RuntimeError("Horovod has been shut down.")
        except RuntimeError:
            raise ValueError("the script's handler failed too")  # raised while handling Horovod's error
    except ValueError as chained:
        assert is_follower(chained)
    assert not is_follower(RuntimeError("data loader broke"))
    assert not is_follower(KeyError("label"))


@pytest.mark.unit
def test_the_first_failure_is_the_earliest_cause_else_the_earliest_follower(tmp_path):
    def note(rank: int, at: float, follower: bool) -> None:
        (tmp_path / f"rank{rank}.json").write_text(
            f'{{"rank": {rank}, "error": "E{rank}", "raised_at": {at}, "follower": {str(follower).lower()}}}')
    assert first_failure(str(tmp_path)) is None
    note(0, 10.0, True)
    assert first_failure(str(tmp_path)) == FailureNote(0, "E0", 10.0, True)
    note(2, 12.0, False)
    note(1, 11.0, False)
    (tmp_path / "rank3.json.tmp").write_text("{")  # a note being written
    (tmp_path / "rank4.json").write_text("{not json")  # a rank killed while writing
    assert first_failure(str(tmp_path)) == FailureNote(1, "E1", 11.0, False)
    assert first_failure(str(tmp_path / "missing")) is None


@pytest.mark.unit
def test_an_uncaught_exception_is_noted_then_reported_as_before(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(envvars.FAILURE_NOTES, str(tmp_path))
    monkeypatch.setenv(envvars.HOROVOD_RANK, "3")
    monkeypatch.setattr(failure_notes, "_previous_hook", None)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    failure_notes.install()
    try:
        raise KeyError("label")
    except KeyError as error:
        started = time.time()
        sys.excepthook(type(error), error, error.__traceback__)
    assert "KeyError: 'label'" in capsys.readouterr().err  # the traceback, as Python prints it
    note = first_failure(str(tmp_path))
    assert note is not None and (note.rank, note.error, note.follower) == (3, "KeyError: 'label'", False)
    assert started <= note.raised_at <= time.time()


@pytest.mark.unit
def test_nothing_is_installed_without_the_launchers_folder(monkeypatch):
    monkeypatch.delenv(envvars.FAILURE_NOTES, raising=False)
    monkeypatch.setattr(failure_notes, "_previous_hook", None)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    failure_notes.install()
    assert sys.excepthook is sys.__excepthook__


RAISES_ON_RANK_1 = """
import torch, hybridsync as hs
hs.init()
model = torch.nn.Linear(4, 2)
opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
for step in range(4):
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    if step == 1 and hs.rank() == 1:
        raise RuntimeError("the data loader broke on rank 1")
"""


@pytest.mark.multiprocess
def test_a_failed_job_names_the_rank_that_raised_not_the_first_to_exit(tmp_path):
    """Rank 1 raises; rank 0 then fails in Horovod ('Horovod has been shut down') and, before, was often
    the rank named (it exits first: rank 1's exit waits in Horovod's shutdown). No folder is left."""
    script = tmp_path / "train.py"
    script.write_text(RAISES_ON_RANK_1)
    scratch = tmp_path / "tmp"  # the launcher's folder is made here: other jobs' are not seen
    scratch.mkdir()
    proc = run_job([str(BIN / "hybridsync-run"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                    str(script)], timeout=180, env={"TMPDIR": str(scratch)})
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1] == (
        "hybridsync-run: error: rank 1 failed: RuntimeError: the data loader broke on rank 1; horovodrun "
        "stopped the others (the ranks' output above has the traceback)"), proc.stdout[-3000:]
    assert list(scratch.glob("hybridsync-failures-*")) == []
