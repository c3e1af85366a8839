"""The model generator (``hybridsync.zoo.generator``): stable names, a catalogue of distinct
architectures within the emulated cluster's budget, models that describe themselves, and
generated models profiled and measured by the trial worker as the zoo's are. (That one model
of each family learns, deterministically, is tested with the zoo's: ``tests/test_zoo.py``.)"""
from __future__ import annotations

import json
import sys

import pytest

torch = pytest.importorskip("torch")

from conftest import BIN, run_job  # noqa: E402
from hybridsync import zoo  # noqa: E402
from hybridsync.description import load_description  # noqa: E402
from hybridsync.trials.store import TrialStore  # noqa: E402
from hybridsync.variables import variables_from_model  # noqa: E402
from hybridsync.zoo import generator  # noqa: E402
from hybridsync.zoo import train as zoo_train  # noqa: E402
from hybridsync.zoo.tabular import RecommenderModel  # noqa: E402

MB = 1e6


def meta_variables(name: str) -> dict:
    """The model's variables, built on the meta device (shapes only: instant even for 60 MB)."""
    with torch.device("meta"):
        return variables_from_model(zoo.get(name).build())


@pytest.mark.unit
def test_the_catalogue_holds_30_distinct_architectures_of_every_family_within_the_budget():
    names = generator.GENERATED_MODELS
    assert len(names) >= 30 and {generator.parse_name(n)[0] for n in names} == set(generator.FAMILIES)
    architectures, totals = set(), []
    for name in names:
        variables = meta_variables(name)
        architectures.add(tuple((v.name, v.shape, v.sparse) for v in variables.values()))
        total = sum(v.nbytes for v in variables.values())
        dense = sum(v.nbytes for v in variables.values() if not v.sparse)
        assert generator.TOTAL_BYTES[0] <= total <= generator.TOTAL_BYTES[1], name
        assert generator.DENSE_BYTES[0] <= dense <= generator.DENSE_BYTES[1], name
        model = zoo.get(name)
        with torch.device("meta"):
            built = model.build()
        assert generator.forward_macs(model, built) * model.batch_size <= generator.STEP_MACS, name
        totals.append(total)
    assert len(architectures) == len(names), "two catalogue names build the same architecture"
    assert min(totals) < 2 * MB and max(totals) > 40 * MB, "sizes should span ~1-60 MB"


@pytest.mark.unit
def test_a_name_builds_the_same_architecture_on_every_machine():
    """Pinned draws: a change of the samplers or of numpy's streams would rename every model of
    the dataset, so it must show here."""
    recsys = zoo.get("gen-recsys-2")
    assert isinstance(recsys, RecommenderModel)
    assert (recsys.tables, recsys.dim, recsys.hidden, recsys.batch_size, recsys.popularity) == (
        (200000, 1000, 5000, 100000, 5000, 500000, 100000, 1000), 16, (512, 128, 64), 128, 2.0)
    cnn = zoo.get("gen-cnn-1")
    assert (cnn.architecture, cnn.channels, cnn.blocks, cnn.image_size, cnn.batch_size) == (
        "resnet", (16, 32, 64, 64), (4, 2, 1, 4), 8, 64)
    transformer = zoo.get("gen-transformer-4")
    assert (transformer.vocab, transformer.dim, transformer.heads, transformer.ffn, transformer.blocks,
            transformer.seq_len, transformer.batch_size) == (3000, 160, 4, 320, 3, 16, 16)
    assert zoo.get("gen-widedeep-3").wide_rows == 4 * 1024 * 1024
    assert zoo.get("gen-mlp-1").hidden == (512, 1024, 256, 2048)
    generator.generate.cache_clear()
    assert generator.generate("gen-recsys-2") == recsys, "a pure function of the name"


@pytest.mark.unit
def test_describe_marks_the_sparse_tables_and_nothing_else():
    sparse = {name for name, v in meta_variables("gen-widedeep-0").items() if v.sparse}
    tables = len(zoo.get("gen-widedeep-0").tables)
    assert sparse == {"wide.weight"} | {f"tables.{i}.weight" for i in range(tables)}
    recsys = meta_variables("gen-recsys-0")
    assert {n for n, v in recsys.items() if v.sparse} == {f"tables.{i}.weight" for i in range(5)}
    assert sum(v.nbytes for v in recsys.values() if not v.sparse) < 0.1 * sum(v.nbytes for v in recsys.values())
    for name in ("gen-mlp-0", "gen-cnn-0", "gen-transformer-0"):
        assert not any(v.sparse for v in meta_variables(name).values()), name
    assert zoo.describe("gen-mlp-0") == meta_variables("gen-mlp-0")


@pytest.mark.unit
@pytest.mark.parametrize("bad", ["gen-rnn-1", "gen-mlp-01", "gen-mlp--1", "gen-mlp", "gen-mlp-1x"])
def test_a_malformed_name_says_what_names_exist(bad):
    assert not zoo.is_model(bad)
    with pytest.raises(ValueError, match="gen-<family>-<k>.*recsys, mlp, cnn, transformer, widedeep"):
        zoo.get(bad)
    assert zoo.is_model("gen-mlp-123") and zoo.is_model("ncf")


@pytest.mark.unit
def test_the_catalogue_command_and_describe_take_generated_names(tmp_path, capsys):
    assert zoo_train.main(["--catalogue"]) == 0
    table = capsys.readouterr().out
    assert all(f"`{name}`" in table for name in generator.GENERATED_MODELS)
    out = tmp_path / "d.json"
    assert zoo_train.main(["--model", "gen-recsys-4", "--describe", "--batch-size", "8", "-o", str(out)]) == 0
    assert "sparse tensors 4" in capsys.readouterr().out
    assert zoo_train.main(["--model", "gen-nope-1", "--describe"]) == 2


@pytest.mark.multiprocess
def test_a_generated_model_is_profiled_as_the_zoo_is(tmp_path):
    out = tmp_path / "gen-widedeep-0.json"
    argv = [str(BIN / "hybridsync"), "profile", "--steps", "3", "--warmup", "1", "--name", "gen-widedeep-0",
            "-o", str(out), "--", sys.executable, "-m", "hybridsync.zoo.train", "--model", "gen-widedeep-0"]
    proc = run_job(argv, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:]
    description = load_description(out)
    assert description.name == "gen-widedeep-0" and description.timing is not None
    assert {n: v.sparse for n, v in description.variables.items()} == {
        n: v.sparse for n, v in meta_variables("gen-widedeep-0").items()}
    assert all(description.variable_timing[n].rows_touched for n, v in description.variables.items() if v.sparse)


@pytest.mark.multiprocess
def test_a_generated_model_runs_under_the_trial_worker(tmp_path):
    """Plain Horovod, every baseline (sparse tables on the servers included) and random strategies
    of a wide & deep model in a 2-rank job: every trial measured, none failed."""
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes: 1\nworkers_per_node: 2\ninter_node_bandwidth: 1gbit\nservers_per_node: 1\n")
    store = f"sqlite:///{tmp_path / 'trials.db'}"
    argv = [str(BIN / "hybridsync"), "trials", "run", "--model", "gen-widedeep-0", "--cluster", str(spec),
            "-H", "localhost:2", "--sample", "2", "--store", store, "--warmup", "1", "--steps", "3",
            "--trial-timeout", "60", "--workdir", str(tmp_path)]
    proc = run_job(argv, timeout=400)
    assert proc.returncode == 0, proc.stdout[-5000:]
    with TrialStore(store) as trials:
        records = trials.trials()
    kinds = {r.kind for r in records}
    assert "horovod" in kinds and "baseline:parallax" in kinds and sum(k == "random" for k in kinds) <= 1
    assert sum(r.kind == "random" for r in records) == 2
    failed = [(r.kind, r.reason) for r in records if r.status != "ok"]
    assert not failed, json.dumps(failed)[:3000]
    assert all(len(r.step_times) == 4 and r.median_s > 0 for r in records)
    assert {r.model for r in records} == {"gen-widedeep-0"}
