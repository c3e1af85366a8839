"""The profiled model description and the profiler that writes it.

Unit: description round trip, id stability, old plain files, every validation error named
at once; the ``Profiler`` in process (hooks undone, updates unchanged); its environment
checks; the command's argument parsing. Jobs (one process each, ``tests/workers/profile_train.py``:
a sparse embedding with a known number of distinct ids per step and three Linear layers):
``hybridsync profile`` writes a valid description with plausible timing, the script stops
with exit code 0 after the configured steps with the same parameters as an unprofiled run,
the command's errors, and two ranks refused.
"""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from conftest import REPO, WORKERS, launcher_argv, run_job
from hybridsync import envvars
from hybridsync.cli import build_parser
from hybridsync.hooks import StepHook, StepHookBuilder, profiler
from hybridsync.description import (ComputeTiming, ModelDescription, VariableTiming, description_id,
                                    load_description, load_model_description, parse_description, save_description,
                                    save_model_description)
from hybridsync.run.profile import profile_command
from hybridsync.variables import VariableInfo

WARMUP, STEPS = 2, 5
UNIQUE_IDS = 24  # tests/workers/profile_train.py: distinct embedding rows per step


def _description(**changes) -> ModelDescription:
    variables = {"emb": VariableInfo(name="emb", shape=(100, 4), sparse=True),
                 "w": VariableInfo(name="w", shape=(4, 2)), "b": VariableInfo(name="b", shape=(2,))}
    desc = ModelDescription(
        variables=variables, name="tiny",
        timing=ComputeTiming(forward_s=0.001, backward_s=0.002, optimizer_s=0.0005, step_s=0.004, steps=10,
                             batch_size=32),
        variable_timing={"b": VariableTiming(ready_order=0, ready_s=0.0001),
                         "w": VariableTiming(ready_order=1, ready_s=0.0002),
                         "emb": VariableTiming(ready_order=2, ready_s=0.0015, rows_touched=17)},
        meta={"host": "a", "date": "2026-11-23T00:00:00+00:00"})
    return dataclasses.replace(desc, **changes)


# --- unit: the description ---------------------------------------------------------------------------

@pytest.mark.unit
def test_description_round_trips_one_variable_per_line(tmp_path):
    desc = _description()
    save_description(desc, tmp_path / "d.json")
    text = (tmp_path / "d.json").read_text()
    assert load_description(tmp_path / "d.json") == desc
    assert parse_description(json.loads(text)) == desc == parse_description(desc.to_dict())
    variable_lines = [line for line in text.splitlines() if line.lstrip().startswith('{"name"')]
    assert len(variable_lines) == 3, text
    assert load_model_description(tmp_path / "d.json") == desc.variables  # the plain reader still reads it


@pytest.mark.unit
def test_description_id_is_stable_and_names_content_not_provenance():
    desc = _description()
    assert description_id(desc) == "7330fcd0f29c97b1"  # the same on every machine: canonical JSON, sha256
    reordered = dict(reversed(list(desc.variables.items())))
    assert description_id(dataclasses.replace(desc, variables=reordered, meta={"host": "b"})) == description_id(desc)
    slower = dataclasses.replace(desc.timing, backward_s=0.003)
    assert description_id(dataclasses.replace(desc, timing=slower)) != description_id(desc)
    assert description_id(dataclasses.replace(desc, name="other")) != description_id(desc)
    assert re.fullmatch(r"[0-9a-f]{16}", description_id(desc))


@pytest.mark.unit
def test_description_functions_keep_their_old_import_paths():
    import hybridsync.cli
    import hybridsync.description
    import hybridsync.model_source
    import hybridsync.variables
    for name in ("load_model_description", "parse_model_description", "save_model_description",
                 "parse_variable_entries"):
        assert getattr(hybridsync.variables, name) is getattr(hybridsync.description, name)
    assert hybridsync.model_source.load_model_variables is hybridsync.cli.load_model_variables
    with pytest.raises(AttributeError, match="no attribute 'load_description'"):
        hybridsync.variables.load_description  # noqa: B018 (only the names that lived there)


@pytest.mark.unit
def test_plain_descriptions_keep_loading_without_timing(tmp_path):
    variables = {"w": VariableInfo(name="w", shape=(3, 2)), "e": VariableInfo(name="e", shape=(9, 2), sparse=True)}
    save_model_description(variables, tmp_path / "plain.json")
    desc = load_description(tmp_path / "plain.json")
    assert desc.variables == variables
    assert desc.timing is None and desc.variable_timing == {} and desc.name is None
    (tmp_path / "minimal.json").write_text('{"variables": [{"name": "x", "shape": [2]}]}')
    assert load_description(tmp_path / "minimal.json").variables["x"] == VariableInfo(name="x", shape=(2,))


@pytest.mark.unit
def test_every_mistake_in_a_description_is_named_in_one_error():
    doc = _description().to_dict()
    doc["extra"] = 1
    doc["version"] = 7
    doc["timing"].update(forward_s=-0.5, flops=3)
    emb, w, b = doc["variables"]
    emb.update(ready_order=5, colour="red")
    w.update(rows_touched=3, ready_s=-1.0)
    b.update(sparse="yes")
    del b["ready_s"]
    with pytest.raises(ValueError) as error:
        parse_description(doc, where="d.json")
    message = str(error.value)
    for culprit in ("d.json", "unknown top-level field 'extra'", "version 7", "timing: unknown field 'flops'",
                    "'emb': unknown field 'colour'", "'w': ready_s must be a finite number >= 0, got -1.0",
                    "'b': sparse must be true or false", "'b': ready_order and ready_s go together",
                    "ready_order must number"):
        assert culprit in message, (culprit, message)
    doc = _description().to_dict()
    doc["timing"]["forward_s"] = -0.5
    doc["variables"][1]["rows_touched"] = 5  # a dense variable may have it (its nonzero rows), within its rows
    with pytest.raises(ValueError, match=r"(?s)forward_s must be .* >= 0.*'w': rows_touched 5 exceeds its 4 rows"):
        parse_description(doc)


@pytest.mark.unit
def test_ready_order_must_agree_with_ready_times_and_rows_fit_the_variable():
    timing = dict(_description().variable_timing)
    timing["emb"] = VariableTiming(ready_order=2, ready_s=0.00005, rows_touched=101)
    with pytest.raises(ValueError) as error:
        _description(variable_timing=timing)
    assert "'emb': ready_s 5e-05 is before that of 'w'" in str(error.value)
    assert "'emb': rows_touched 101 exceeds its 100 rows" in str(error.value)
    with pytest.raises(ValueError, match="ready_order must number the 2 timed variables 0..1"):
        _description(variable_timing={"w": VariableTiming(ready_order=0, ready_s=0.1),
                                      "b": VariableTiming(ready_order=0, ready_s=0.1)})
    with pytest.raises(ValueError, match="'ghost': has timing but is not among the variables"):
        _description(variable_timing={"ghost": VariableTiming(ready_order=0, ready_s=0.1)})
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        ComputeTiming(forward_s=0, backward_s=0, optimizer_s=0, step_s=0, steps=0)


@pytest.mark.unit
def test_load_description_names_the_file(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        load_description(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="cannot read model description"):
        load_description(tmp_path / "missing.json")


# --- unit: the profiler in process ---------------------------------------------------------------------

class _Net(torch.nn.Module):
    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 4, sparse=sparse)
        self.fc = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids))))


def _train(steps: int, prof_path=None, *, sparse: bool = True) -> tuple[dict, profiler.Profiler | None]:
    torch.manual_seed(0)
    model = _Net(sparse)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prof = None if prof_path is None else profiler.Profiler(prof_path, list(model.named_parameters()), steps=3,
                                                            warmup=1)
    ended = []
    for step in range(steps):
        opt.zero_grad()
        ids = torch.arange(10) % 7 + step
        torch.nn.functional.mse_loss(model(ids), torch.ones(10, 1)).backward()
        if prof is not None:  # as DistributedOptimizer.step() calls it
            prof.before_step()
        opt.step()
        if prof is not None:
            ended.append(prof.after_step())
    if prof is not None:  # the run is over after the 4th step (1 warm-up + 3 profiled), and only then
        assert ended == [False, False, False, True] + [False] * (steps - 4), ended
    return {k: v.clone() for k, v in model.state_dict().items()}, prof


@pytest.mark.unit
def test_profiler_measures_without_changing_the_updates_and_undoes_its_hooks(tmp_path):
    original_backward = torch.autograd.backward
    plain, _ = _train(6)
    profiled, _ = _train(6, tmp_path / "p.json")
    assert torch.autograd.backward is original_backward  # restored after the last profiled step (4th)
    assert all(torch.equal(plain[k], profiled[k]) for k in plain)
    desc = load_description(tmp_path / "p.json")
    assert desc.timing.steps == 3 and desc.variables["emb.weight"].sparse
    assert not desc.variables["fc.weight"].sparse
    assert desc.variable_timing["emb.weight"].rows_touched == 7
    order = sorted(desc.variable_timing, key=lambda name: desc.variable_timing[name].ready_order)
    assert order[0].startswith("head.") and order[-1] == "emb.weight", order
    assert desc.meta["torch"] == torch.__version__


@pytest.mark.unit
def test_profiler_counts_the_nonzero_rows_of_a_dense_embedding_and_keeps_them_only_when_fewer_than_all(tmp_path):
    _train(4, tmp_path / "p.json", sparse=False)
    desc = load_description(tmp_path / "p.json")
    assert not desc.variables["emb.weight"].sparse
    assert desc.variable_timing["emb.weight"].rows_touched == 7  # 10 ids, 7 distinct, of 50 rows
    assert desc.variable_timing["head.weight"].rows_touched is None  # its one row is nonzero
    assert desc.variable_timing["fc.bias"].rows_touched is None or desc.variable_timing["fc.bias"].rows_touched < 8
    assert desc.timing.step_s > 0


@pytest.mark.unit
def test_a_frozen_parameter_is_left_out_of_the_description_and_an_unused_one_kept(tmp_path):
    """A frozen parameter (fine-tuning) sends nothing at run time; in the description the simulator
    priced it as a message ready at the end of the backward pass (a frozen 94 MB embedding: a
    94 MB all-reduce a step that never runs). A trainable one that gets no gradient stays: the
    runtime sends its zeros, as Horovod does."""
    torch.manual_seed(0)
    model = _Net(False)
    model.emb.weight.requires_grad_(False)
    unused = torch.nn.Linear(3, 3)
    named = [*model.named_parameters(), *(("unused." + n, p) for n, p in unused.named_parameters())]
    prof = profiler.Profiler(tmp_path / "p.json", named, steps=2, warmup=0)
    opt = torch.optim.SGD([p for _, p in named if p.requires_grad], lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.arange(10) % 7), torch.ones(10, 1)).backward()
        prof.before_step()
        opt.step()
        prof.after_step()
    desc = load_description(tmp_path / "p.json")
    assert "emb.weight" not in desc.variables
    assert {"fc.weight", "head.bias", "unused.weight", "unused.bias"} <= set(desc.variables)
    assert "unused.weight" not in desc.variable_timing and "fc.weight" in desc.variable_timing


@pytest.mark.unit
def test_nonzero_row_count():
    grad = torch.zeros(5, 3)
    grad[1, 2], grad[3] = 1.0, -2.0
    assert profiler.nonzero_rows(grad) == 2 and profiler.nonzero_rows(torch.tensor([0.0, 1.0, 0.0])) == 1


@pytest.mark.unit
def test_profiler_settings_from_the_environment(monkeypatch, tmp_path):
    named = list(torch.nn.Linear(2, 1).named_parameters())
    builder = StepHookBuilder()
    monkeypatch.delenv(envvars.PROFILE, raising=False)
    assert builder.profiler_from_environment(named, num_ranks=4) is None
    monkeypatch.setenv(envvars.PROFILE, str(tmp_path / "d.json"))
    with pytest.raises(ValueError, match="this job has 2 ranks: profiling runs on one process"):
        builder.profiler_from_environment(named, num_ranks=2)
    monkeypatch.setenv(envvars.PROFILE_STEPS, "zero")
    with pytest.raises(ValueError, match="HYBRIDSYNC_PROFILE_STEPS='zero': expected an integer >= 1"):
        builder.profiler_from_environment(named, num_ranks=1)
    monkeypatch.setenv(envvars.PROFILE_STEPS, "4")
    first = builder.profiler_from_environment(named, num_ranks=1)
    try:
        assert isinstance(first, StepHook)
        assert (first.steps, first.warmup) == (4, envvars.PROFILE_WARMUP_DEFAULT)
        # a second optimizer's variables join the running profile; one rebuilt over the same parameters
        # adds nothing; other parameters under names it already has are left out, with a warning
        other = [("emb.weight", torch.nn.Parameter(torch.zeros(3, 2)))]
        assert builder.profiler_from_environment(other, num_ranks=1) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert builder.profiler_from_environment(named, num_ranks=1) is None
        assert [name for name, _ in first._named] == ["weight", "bias", "emb.weight"]
        with pytest.warns(UserWarning, match="variables weight, bias are not profiled: another optimizer's"):
            assert builder.profiler_from_environment(list(torch.nn.Linear(2, 1).named_parameters()), 1) is None
    finally:
        first.close()
    again = builder.profiler_from_environment(named, num_ranks=1)  # the first one closed: the next one may profile
    assert again is not None
    again.close()


@pytest.mark.unit
def test_profile_command_line():
    argv = ["profile", "-o", "d.json", "--steps", "4", "--", "python", "t.py", "--steps", "9"]
    args = build_parser().parse_args(argv)
    assert args.cmd[-4:] == ["python", "t.py", "--steps", "9"] and args.steps == 4 and args.warmup == 3
    with pytest.raises(ValueError, match="no command to profile"):
        profile_command([], output="d.json")


@pytest.mark.unit
def test_a_profile_without_a_name_is_named_after_its_script_and_variables():
    from hybridsync.run.profile import default_name
    lstm = ModelDescription(variables={"embedding.weight": VariableInfo(name="embedding.weight", shape=(10, 4))})
    other = ModelDescription(variables={"embedding.weight": VariableInfo(name="embedding.weight", shape=(10, 8))})
    name = default_name(["python", "examples/heldout/lstm_lm.py", "--steps", "9"], lstm)
    assert re.fullmatch(r"lstm_lm-[0-9a-f]{8}", name)
    assert default_name(["/usr/bin/python3", "-u", "/elsewhere/lstm_lm.py"], lstm) == name, "one model, one name"
    assert default_name(["python", "lstm_lm.py"], other) != name, \
        "another model of the same script: its trials must not mix with this one's in a shared store"
    assert default_name(["python", "-m", "hybridsync.zoo.keras_ncf", "--steps", "3"], lstm).startswith("keras_ncf-")


# --- jobs: one profiled process each -------------------------------------------------------------------

def _hybridsync(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_job([sys.executable, "-m", "hybridsync.cli", *args], timeout=timeout)


def _train_command(*args: str) -> list[str]:
    return [sys.executable, str(WORKERS / "profile_train.py"), *args]


@pytest.mark.parametrize("optimizers", [[], ["--two-optimizers"], ["--rebuild"], ["--late-head"]],
                         ids=["one-optimizer", "two-optimizers", "rebuilt", "head-added-later"])
@pytest.mark.multiprocess
def test_hybridsync_profile_writes_a_valid_description(tmp_path, optimizers):
    """With two optimizers (the embedding's, the dense layers'), the one model is described whole; with
    one rebuilt over the same parameters (the first never steps), the new one times the steps; with a
    head that ``add_param_group`` adds after a step (fine-tuning), the head is described too (it was
    left out: the search never routed it)."""
    out = tmp_path / "profiles" / "desc.json"  # a folder not made yet: made before the script runs
    proc = _hybridsync("profile", "--steps", str(STEPS), "--warmup", str(WARMUP), "--timeout", "120",
                       "--name", "tiny", "--batch-size", "64", "-o", str(out), "--",
                       *_train_command("--steps", "100000", *optimizers))
    assert proc.returncode == 0, proc.stdout
    desc = load_description(out)
    assert f"wrote {out} (id {description_id(desc)}): 7 variables (1 sparse)" in proc.stdout, proc.stdout
    assert "first head." in proc.stdout and "last emb.weight" in proc.stdout, proc.stdout
    assert list(out.parent.iterdir()) == [out]  # the partial file is gone
    assert desc.name == "tiny" and desc.timing.batch_size == 64 and desc.timing.steps == STEPS
    assert set(desc.variable_timing) == set(desc.variables)
    assert [name for name, v in desc.variables.items() if v.sparse] == ["emb.weight"]
    assert desc.variable_timing["emb.weight"].rows_touched == UNIQUE_IDS
    order = sorted(desc.variable_timing, key=lambda name: desc.variable_timing[name].ready_order)
    assert order[0].startswith("head.") and order[-1] == "emb.weight", order
    ready = [desc.variable_timing[name].ready_s for name in order]
    assert ready == sorted(ready) and ready[-1] <= desc.timing.backward_s
    t = desc.timing
    assert min(t.forward_s, t.backward_s, t.optimizer_s) > 0
    assert t.step_s >= 0.9 * (t.forward_s + t.backward_s + t.optimizer_s), t  # medians: a little slack


@pytest.mark.multiprocess
def test_profiling_a_zoo_model_by_name_leaves_no_temporary_folder(tmp_path, monkeypatch):
    """``hybridsync search --model ncf`` (and the autotune benchmark) profile a zoo model into a
    temporary folder; each run left one behind (``hybridsync-profile-*``, the description in it)."""
    import tempfile
    from hybridsync.autotune.session import load_or_profile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    description = load_or_profile("ncf")
    assert description.name == "ncf" and description.timing is not None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
def test_profiled_script_stops_after_its_steps_with_the_updates_of_an_unprofiled_run(tmp_path):
    env = {envvars.PROFILE: str(tmp_path / "d.json"), envvars.PROFILE_STEPS: str(STEPS),
           envvars.PROFILE_WARMUP: str(WARMUP)}
    proc = run_job(_train_command("--steps", "100000", "--params", str(tmp_path / "profiled.pt")), env=env,
                   timeout=120)
    assert proc.returncode == 0, proc.stdout
    steps_printed = re.findall(r"^step (\d+)$", proc.stdout, re.M)
    assert steps_printed[-1] == str(WARMUP + STEPS - 2), proc.stdout  # ended inside the last step()
    assert "trained" not in proc.stdout
    assert f"hybridsync profile: wrote {tmp_path / 'd.json'} after {WARMUP + STEPS} steps" in proc.stdout
    load_description(tmp_path / "d.json")
    proc = run_job(_train_command("--steps", str(WARMUP + STEPS), "--params", str(tmp_path / "plain.pt")),
                   timeout=120)
    assert proc.returncode == 0, proc.stdout
    profiled, plain = torch.load(tmp_path / "profiled.pt"), torch.load(tmp_path / "plain.pt")
    assert all(torch.equal(profiled[k], plain[k]) for k in plain)


@pytest.mark.multiprocess
def test_hybridsync_profile_errors(tmp_path):
    out = tmp_path / "d.json"
    failing = _hybridsync("profile", "-o", str(out), "--", sys.executable, "-c",
                          "import sys; print('loading data'); sys.exit(3)")
    assert failing.returncode == 1
    assert "the command failed with exit code 3" in failing.stdout and "| loading data" in failing.stdout
    unwrapped = _hybridsync("profile", "-o", str(out), "--", sys.executable, "-c", "print('trained')")
    assert unwrapped.returncode == 1
    assert "without writing a description: did it wrap its optimizer in hybridsync.DistributedOptimizer" \
        in unwrapped.stdout and "| trained" in unwrapped.stdout
    too_short = _hybridsync("profile", "-o", str(out), "--", *_train_command("--steps", "4"))
    assert too_short.returncode == 1 and "run at least 13 steps (3 warm-up + 10)" in too_short.stdout
    hanging = _hybridsync("profile", "--timeout", "3", "-o", str(out), "--", sys.executable, "-c",
                          "import time; print('waiting', flush=True); time.sleep(60)")
    assert hanging.returncode == 1 and "did not finish within 3 s" in hanging.stdout and "| waiting" in hanging.stdout
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.multiprocess
def test_profiling_two_ranks_is_refused(tmp_path):
    proc = run_job(launcher_argv("horovodrun") + _train_command("--steps", "50"),
                   env={envvars.PROFILE: str(tmp_path / "d.json")}, timeout=120)
    assert proc.returncode != 0
    assert "this job has 2 ranks: profiling runs on one process" in proc.stdout, proc.stdout[-3000:]
    assert not (tmp_path / "d.json").exists()


@pytest.mark.multiprocess
def test_description_and_profile_command_import_without_torch():
    program = textwrap.dedent("""
        import sys
        class Blocked:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "horovod", "numpy"):
                    raise ImportError(f"{name} is blocked")
        sys.meta_path.insert(0, Blocked())
        import hybridsync.cli, hybridsync.description, hybridsync.run.profile
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
