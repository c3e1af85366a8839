"""The benchmark model zoo: each model has the synchronization profile it stands for, learns
its synthetic task (so does one generated model of each family), and trains as a real 2-rank job (hybridsync with mixed routes, Horovod's
optimizer, mpirun) with every rank ending on the same parameters."""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from conftest import BIN, launcher_argv, run_job  # noqa: E402
from hybridsync import baselines, cli, zoo  # noqa: E402
from hybridsync.strategy import Strategy  # noqa: E402
from hybridsync.description import load_model_description, save_model_description  # noqa: E402
from hybridsync.zoo import train  # noqa: E402

MB = 1e6
LEARNERS = zoo.ZOO_MODELS + tuple(f"gen-{family}-0" for family in zoo.generator.FAMILIES)
"""The zoo and one generated model of each family."""


@pytest.fixture(scope="module")
def stats() -> dict[str, dict]:
    torch.manual_seed(0)
    return {name: zoo.model_stats(zoo.get(name).build()) for name in zoo.ZOO_MODELS}


@pytest.mark.unit
def test_each_model_has_the_profile_it_stands_for(stats):
    ncf, bert, vgg, resnet = (stats[name] for name in ("ncf", "bert", "vgg", "resnet"))
    assert ncf["sparse_tensors"] == 4 and ncf["bytes"] > 10 * MB, "big sparse embeddings"
    assert ncf["dense_bytes"] < 1 * MB, "only a small MLP is dense"
    assert bert["tensors"] >= 30 and bert["sparse_tensors"] == 0
    assert vgg["largest_share"] >= 0.8
    assert resnet["tensors"] >= 100 and resnet["largest_share"] < 0.5
    for name in ("bert", "vgg"):
        assert 3 * MB <= stats[name]["bytes"] <= 8 * MB, name
    assert 1 * MB <= resnet["bytes"] <= 3 * MB


@pytest.mark.unit
def test_model_stats_counts_what_it_says():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    assert zoo.model_stats(model, top=1) == {
        "parameters": 50, "bytes": 200, "dense_bytes": 40, "tensors": 3, "sparse_tensors": 1,
        "largest_tensors": ["0.weight"], "largest_share": 160 / 200}


@pytest.mark.unit
@pytest.mark.parametrize("name", LEARNERS)
def test_a_few_local_steps_decrease_the_loss(name):
    torch.set_num_threads(1)
    zoo_model = zoo.get(name)
    torch.manual_seed(0)
    model = zoo_model.build()
    optimizer = zoo_model.optimizer(model)
    generator = torch.Generator().manual_seed(1)
    losses = [zoo.train_step(zoo_model, model, optimizer, zoo_model.make_batch(generator)) for _ in range(30)]
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < 0.9 * first, f"{name}: loss {first:.3f} -> {last:.3f}"


@pytest.mark.unit
@pytest.mark.parametrize("name", LEARNERS)
def test_build_and_batches_are_deterministic(name):
    zoo_model = zoo.get(name)
    states = []
    for _ in range(2):
        torch.manual_seed(3)
        states.append(zoo_model.build().state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    first, again, other = (zoo_model.make_batch(torch.Generator().manual_seed(seed), 8) for seed in (5, 5, 6))
    leaves = torch.utils._pytree.tree_leaves  # inputs may be a tuple of tensors
    assert all(torch.equal(a, b) for a, b in zip(leaves(first), leaves(again)))
    assert not torch.equal(leaves(first)[0], leaves(other)[0])
    assert len(first[1]) == 8


@pytest.mark.unit
def test_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match="known: ncf, bert, vgg, resnet"):
        zoo.get("alexnet")


@pytest.mark.unit
def test_describe_marks_sparse_embeddings():
    variables = zoo.describe("ncf")
    assert {name for name, v in variables.items() if v.sparse} == {
        "gmf_user.weight", "gmf_item.weight", "mlp_user.weight", "mlp_item.weight"}


@pytest.mark.unit
def test_explain_and_baseline_take_a_zoo_model(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert cli.main(["baseline", "parallax", "--model", "ncf", "-o", str(out)]) == 0
    routes = {name: config.route for name, config in Strategy.load(out).variables.items()}
    assert routes["gmf_user.weight"] == "ps" and routes["predict.weight"] == "allreduce"
    capsys.readouterr()
    assert cli.main(["explain", str(out), "--model", "ncf"]) == 0
    assert "gmf_user.weight" in capsys.readouterr().out


@pytest.mark.unit
def test_a_description_file_wins_over_a_zoo_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    save_model_description({"w": zoo.describe("vgg")["classifier.0.weight"]}, tmp_path / "vgg")
    assert cli.main(["baseline", "allreduce", "--model", "vgg", "-o", "s.json"]) == 0
    assert set(Strategy.load(tmp_path / "s.json").variables) == {"classifier.0.weight"}
    assert cli.main(["explain", "s.json", "--model", "bogus"]) == 2
    error = capsys.readouterr().err
    assert "'bogus'" in error and "description file" in error and "ncf, bert, vgg, resnet" in error


@pytest.mark.unit
def test_describe_command_writes_the_description(tmp_path, capsys):
    out = tmp_path / "resnet.json"
    assert train.main(["--model", "resnet", "--describe", "-o", str(out), "--batch-size", "2"]) == 0
    assert len(load_model_description(out)) == 110
    printed = capsys.readouterr().out
    assert "tensors 110" in printed and re.search(r"forward\+backward [\d.]+ ms", printed)


def mixed_strategy(name: str, path: Path) -> Path:
    """Parallax for the sparse model; for the dense ones the largest tensor on the server in two
    shards, the rest ring all-reduced (half of them fused): every job mixes routes."""
    variables = zoo.describe(name)
    if name == "ncf":
        strategy = baselines.parallax(variables, num_servers=1)
    else:
        largest = max(variables.values(), key=lambda v: v.nbytes).name
        rest = [n for n in variables if n != largest]
        strategy = Strategy.from_dict({"default": {"route": "allreduce"}, "variables": {
            largest: {"route": "ps", "partitions": 2}, **{n: {"route": "allreduce", "group": 0}
                                                          for n in rest[:len(rest) // 2]}}})
    strategy.save(path)
    return path


def check_report(path: Path, ranks: int = 2) -> dict:
    """The job's report says: every rank ended with the same parameters, and the loss fell."""
    report = json.loads(path.read_text())
    assert len(report["parameter_checksums"]) == ranks
    assert len(set(report["parameter_checksums"])) == 1, "ranks' parameters differ"
    losses = report["losses"]
    assert statistics.mean(losses[-5:]) < 0.9 * statistics.mean(losses[:5]), losses
    assert len(report["step_seconds"]) == report["warmup"] + report["steps"]
    return report


TRAIN = [sys.executable, "-m", "hybridsync.zoo.train", "--warmup", "5", "--steps", "25"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", zoo.ZOO_MODELS)
def test_zoo_model_trains_with_mixed_routes_on_two_ranks(name, tmp_path):
    pytest.importorskip("horovod.torch")
    strategy = mixed_strategy(name, tmp_path / "s.json")
    argv = [str(BIN / "hybridsync-run"), "--num-servers", "1", "-np", "2", "-H", "localhost:2", "--gloo",
            "--strategy", str(strategy), *TRAIN, "--model", name, "--json", str(tmp_path / "out.json")]
    proc = run_job(argv, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    check_report(tmp_path / "out.json")
    pushed = re.search(r"counters \{'pushed_bytes': (\d+)", proc.stdout)
    assert pushed and int(pushed.group(1)) > 0, "nothing went through the server"


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher, name, optimizer", [("mpirun", "resnet", "hybridsync"),
                                                       ("horovodrun", "bert", "horovod")])
def test_zoo_model_trains_under_other_launchers_and_horovod(launcher, name, optimizer, tmp_path):
    pytest.importorskip("horovod.torch")
    argv = launcher_argv(launcher) + [*TRAIN, "--model", name, "--optimizer", optimizer,
                                      "--json", str(tmp_path / "out.json")]
    proc = run_job(argv, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert check_report(tmp_path / "out.json")["optimizer"] == optimizer


@pytest.mark.multiprocess
def test_a_recommender_trains_without_torch_warnings():
    """The tabular models' Adagrad takes sparse gradients; torch warned once per process that its
    sparse tensors skip their invariant checks (its default) unless the program says so."""
    proc = run_job([*TRAIN[:3], "--warmup", "1", "--steps", "3", "--model", "gen-recsys-3"], timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "Warning" not in proc.stdout and "gen-recsys-3 on 1 ranks" in proc.stdout, proc.stdout[-4000:]


@pytest.mark.multiprocess
def test_importing_hybridsync_does_not_import_the_zoo():
    code = "import sys, hybridsync, hybridsync.cli; print(sorted(m for m in sys.modules if 'zoo' in m or m == 'torch'))"
    proc = run_job([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout
