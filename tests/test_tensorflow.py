"""hybridsync.tensorflow on real 2- and 4-rank jobs, against horovod.tensorflow and the whole batch.

``tests/workers/tf_train.py`` trains a small Keras model (dense layers and a sparse
embedding, so ``tf.IndexedSlices`` gradients) for a few steps through each API:
``DistributedGradientTape`` eagerly and in a ``tf.function``, the Keras optimizer under
``model.fit`` and in a custom loop. Every rank's final variables must equal:

- horovod.tensorflow's (``DistributedGradientTape`` / its Keras optimizer), run the same way;
- one process training on the whole batch (every rank's shard): with a mean loss and plain
  SGD, that is exactly what averaging the ranks' gradients gives, whatever the route.

Jobs run with ``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is Keras 2, which Horovod 0.28.1's Keras
optimizer needs: under Keras 3 it silently skips the averaging); one test runs Keras 3.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import BIN, WORKERS, horovodrun_args, launcher_argv, run_job

pytest.importorskip("tensorflow", reason="TensorFlow is not installed here (scripts/bootstrap.sh installs it)")

pytestmark = pytest.mark.multiprocess

TRAIN = WORKERS / "tf_train.py"
TF_ENV = {"TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
EXACT = 1e-6
"""Two ranks' float32 gradients summed in another order than the whole batch's: a few ulps."""

MIXED = {"variables": {
    "embedding/embeddings": {"route": "ps", "partitions": 2},
    "hidden/kernel": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 2},
    "hidden/bias": {"route": "allreduce", "group": 1},
    "out/kernel": {"route": "allreduce", "group": 1},
    "out/bias": {"route": "ps"}}}
PS_BSP = {"default": {"route": "ps"}, "variables": {"embedding/embeddings": {"route": "ps", "partitions": 3}}}
HIERARCHICAL = {"default": {"route": "allreduce", "algorithm": "hierarchical"},
                "variables": {"out/bias": {"route": "allreduce", "algorithm": "ring", "group": 1},
                              "out/kernel": {"route": "allreduce", "algorithm": "ring", "group": 1}}}
ASP = {"default": {"route": "ps", "protocol": "asp"}, "variables": {"hidden/kernel": {"route": "allreduce"}}}


def _train(prefix_argv: list[str], out: Path, impl: str, api: str, *flags: str, np_: int = 2,
           env: dict | None = None, timeout: float = 240) -> list[dict]:
    """Each rank's final variables (``{name: array}``, plus ``"_summary"``) of one training job."""
    argv = [*prefix_argv, sys.executable, str(TRAIN), str(out), "--impl", impl, "--api", api, *flags]
    proc = run_job(argv, timeout=timeout, env={**TF_ENV, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-6000:]
    ranks = []
    for rank in range(np_):
        with np.load(f"{out}.rank{rank}.npz") as variables:
            result = {name.replace("|", "/").removesuffix(":0"): variables[name] for name in variables.files}
        result["_summary"] = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        ranks.append(result)
    return ranks


_references: dict[tuple, dict] = {}


HOROVOD_API = {"keras-loop": "tape"}
"""Horovod's way to do what an API does, where it differs: in a custom loop, Horovod's Keras optimizer
averages nothing (it synchronizes in ``model.fit``'s gradient computation, which a custom loop skips),
so Horovod users synchronize with ``DistributedGradientTape``. hybridsync's Keras optimizer synchronizes
in ``apply_gradients``, which both paths go through."""


def _reference(tmp_path_factory, impl: str, api: str, *flags: str, size: int = 2, env: dict | None = None) -> dict:
    """Rank 0's variables of a horovod.tensorflow job, or of one process on the whole batch (cached)."""
    if impl == "horovod":
        api = HOROVOD_API.get(api, api)
    key = (impl, api, flags, size, tuple(sorted((env or {}).items())))
    if key not in _references:
        out = tmp_path_factory.mktemp(f"{impl}-{api}") / "ref"
        if impl == "single":
            _references[key] = _train([], out, "single", api, *flags, "--size", str(size), np_=1, env=env)[0]
        else:
            pytest.importorskip("horovod.tensorflow", reason="Horovod was built without TensorFlow")
            _references[key] = _train(launcher_argv("horovodrun"), out, "horovod", api, *flags, env=env)[0]
    return _references[key]


def _assert_close(ranks: list[dict], reference: dict, tolerance: float, what: str) -> None:
    for rank, variables in enumerate(ranks):
        names = set(variables) - {"_summary"}
        assert names == set(reference) - {"_summary"}
        errors = {name: float(np.abs(variables[name] - reference[name]).max()) for name in names}
        assert max(errors.values()) <= tolerance, f"rank {rank} vs {what}: {errors}"


def _strategy(tmp_path: Path, doc: dict) -> str:
    path = tmp_path / "strategy.json"
    path.write_text(json.dumps({"version": 1, **doc}))
    return str(path)


def _hybridsync_run(strategy: str, *, num_servers: int | None = None, mpi: bool = False, np_: int = 2,
                    hosts: str | None = None) -> list[str]:
    """``hybridsync-run`` with ``strategy`` and ``num_servers`` servers (default: 2 if the strategy routes a
    variable to the PS, else none: servers nothing joins keep a job 60 s past its end, hybridsync-run's grace)."""
    from hybridsync.strategy import Strategy
    if num_servers is None:
        num_servers = 2 if Strategy.load(strategy).uses_ps else 0
    launcher = ["--mpi"] if mpi else ["--gloo"]
    return [str(BIN / "hybridsync-run"), "--strategy", strategy, "--num-servers", str(num_servers), *launcher,
            "-np", str(np_), "-H", hosts or f"localhost:{np_}"]


# --- no strategy: Horovod's ring, through each API and launcher ------------------------------
@pytest.mark.parametrize("launcher, api", [("horovodrun", "tape"), ("horovodrun", "tape-function"),
                                           ("horovodrun", "keras-fit"), ("horovodrun", "keras-loop"),
                                           ("mpirun", "tape-function"), ("mpirun", "keras-fit")])
def test_without_a_strategy_every_rank_ends_where_horovod_does(launcher, api, tmp_path, tmp_path_factory):
    ranks = _train(launcher_argv(launcher), tmp_path / "hs", "hybridsync", api)
    summary = ranks[0]["_summary"]
    assert all(m.startswith("allreduce/ring:") for m in summary["messages"])
    # Horovod's ops express the plan: every API syncs with them, in a graph or eagerly (no pass through the bridge).
    assert summary["horovod_ring"] == [True]
    assert summary["bridged_passes"] == 0, summary
    _assert_close(ranks, _reference(tmp_path_factory, "horovod", api), EXACT, "horovod.tensorflow")
    _assert_close(ranks, _reference(tmp_path_factory, "single", api), EXACT, "the whole batch")


# --- strategies: ps (bsp), mixed routes, hierarchical on two hosts ---------------------------
@pytest.mark.parametrize("case, api, mpi", [("ps_bsp", "keras-fit", False), ("ps_bsp", "tape-function", False),
                                            ("mixed", "tape", False), ("mixed", "keras-loop", False),
                                            ("mixed", "tape-function", True)])
def test_a_strategy_routes_each_variable_and_changes_no_result(case, api, mpi, tmp_path, tmp_path_factory):
    doc = {"ps_bsp": PS_BSP, "mixed": MIXED}[case]
    ranks = _train(_hybridsync_run(_strategy(tmp_path, doc), mpi=mpi), tmp_path / "hs", "hybridsync", api)
    messages = ranks[0]["_summary"]["messages"]
    assert ranks[0]["_summary"]["horovod_ring"] == [False]  # routes Horovod's ops cannot express: the bridge
    if case == "ps_bsp":
        assert all(m.startswith("ps/bsp:") for m in messages) and len(messages) == 3 + 4  # embedding in 3 shards
    else:
        assert "allreduce/hierarchical:hidden/kernel" in messages and "ps/bsp:out/bias" in messages
        assert "allreduce/ring:hidden/bias,out/kernel" in messages  # the group: one fused message
    _assert_close(ranks, _reference(tmp_path_factory, "horovod", api), EXACT, "horovod.tensorflow (ring)")
    _assert_close(ranks, _reference(tmp_path_factory, "single", api), EXACT, "the whole batch")


def test_hierarchical_on_two_hosts_of_two_ranks(tmp_path, tmp_path_factory):
    """4 ranks, ``-H localhost:2,127.0.0.1:2``: intra-host reduce, inter-host all-reduce, sparse embedding included."""
    argv = _hybridsync_run(_strategy(tmp_path, HIERARCHICAL), np_=4, hosts="localhost:2,127.0.0.1:2")
    ranks = _train(argv, tmp_path / "hs", "hybridsync", "keras-fit", np_=4, timeout=300)
    assert "allreduce/hierarchical:embedding/embeddings" in ranks[0]["_summary"]["messages"]
    _assert_close(ranks, _reference(tmp_path_factory, "single", "keras-fit", size=4), EXACT, "the whole batch")


# --- sparse gradients, compression, asynchronous protocols -----------------------------------
def test_sparse_as_dense_equals_horovod(tmp_path, tmp_path_factory):
    ranks = _train(launcher_argv("horovodrun"), tmp_path / "hs", "hybridsync", "tape-function", "--sparse-as-dense")
    _assert_close(ranks, _reference(tmp_path_factory, "horovod", "tape-function", "--sparse-as-dense"), EXACT,
                  "horovod.tensorflow sparse_as_dense")


@pytest.mark.parametrize("api", ["tape", "keras-fit"])
def test_fp16_compression_equals_horovods(api, tmp_path, tmp_path_factory):
    ranks = _train(launcher_argv("horovodrun"), tmp_path / "hs", "hybridsync", api, "--compression", "fp16")
    reference = _reference(tmp_path_factory, "horovod", api, "--compression", "fp16")
    _assert_close(ranks, reference, 1e-4, "horovod.tensorflow with Compression.fp16")
    exact = _reference(tmp_path_factory, "single", api)
    assert max(float(np.abs(ranks[0][n] - exact[n]).max()) for n in exact if n != "_summary") > EXACT, \
        "fp16 on the wire changed nothing: the compression was not applied"


def test_per_variable_fp16_in_a_strategy(tmp_path, tmp_path_factory):
    doc = {"variables": {"hidden/kernel": {"route": "allreduce", "compression": "fp16"},
                         "embedding/embeddings": {"route": "ps", "compression": "fp16"}}}
    ranks = _train(_hybridsync_run(_strategy(tmp_path, doc)), tmp_path / "hs", "hybridsync", "keras-fit")
    exact = _reference(tmp_path_factory, "single", "keras-fit")
    _assert_close(ranks, exact, 1e-3, "the whole batch (fp16 tolerance)")
    errors = {n: float(np.abs(ranks[0][n] - exact[n]).max()) for n in exact if n != "_summary"}
    assert errors["hidden/kernel"] > EXACT and errors["out/bias"] <= EXACT, errors


def test_asp_on_the_parameter_server_trains_and_ranks_agree_after_the_last_pull(tmp_path, tmp_path_factory):
    ranks = _train(_hybridsync_run(_strategy(tmp_path, ASP)), tmp_path / "hs", "hybridsync", "keras-fit",
                   "--steps", "20")
    assert "ps/asp:embedding/embeddings" in ranks[0]["_summary"]["messages"]
    _assert_close(ranks[1:], ranks[0], 0.0, "rank 0 after the final pull")
    untrained = _reference(tmp_path_factory, "single", "keras-fit", "--steps", "0")
    assert ranks[0]["_summary"]["loss"] < 0.5 * untrained["_summary"]["loss"]


def test_set_strategy_switches_a_keras_job_onto_asp_in_flight(tmp_path, tmp_path_factory):
    """Ring for 4 steps, then ASP on the servers for the rest, in one job: the switched-in variables
    join the servers with their trained values (not the mirrors' zeros), so the loss keeps falling."""
    argv = [str(BIN / "hybridsync-run"), "--num-servers", "2", *horovodrun_args()]
    ranks = _train(argv, tmp_path / "hs", "hybridsync", "keras-fit", "--steps", "20",
                   "--switch-to", _strategy(tmp_path, ASP), "--switch-at", "4")
    assert "ps/asp:embedding/embeddings" in ranks[0]["_summary"]["messages"]
    _assert_close(ranks[1:], ranks[0], 0.0, "rank 0 after the final pull")
    untrained = _reference(tmp_path_factory, "single", "keras-fit", "--steps", "0")
    assert ranks[0]["_summary"]["loss"] < 0.5 * untrained["_summary"]["loss"]


PARTITIONED_RING = {"variables": {"hidden/kernel": {"route": "allreduce", "partitions": 2}}}


@pytest.mark.parametrize("start, switch_to, horovod_ops", [
    (None, PARTITIONED_RING, (True, False)),  # Horovod's ops, then a plan they cannot express
    (PS_BSP, {}, (False, True)),              # the parameter server, then every variable ring all-reduced
    (PS_BSP, MIXED, (False, False)),          # one plan on the overlapped bridge, then another
])
def test_set_strategy_moves_a_traced_step_between_horovods_ops_and_the_bridge(start, switch_to, horovod_ops, tmp_path,
                                                                              tmp_path_factory):
    """``model.fit`` traces its step once; ``set_strategy`` at step 3 of 8 must change how that traced
    step syncs (the bridge's passes count the steps that went through it), with every rank still
    ending where Horovod's Keras optimizer does."""
    argv = (_hybridsync_run(_strategy(tmp_path, start)) if start else
            [str(BIN / "hybridsync-run"), *horovodrun_args()])
    switch = tmp_path / "switch.json"
    switch.write_text(json.dumps({"version": 1, **switch_to}))
    ranks = _train(argv, tmp_path / "hs", "hybridsync", "keras-fit", "--steps", "8", "--switch-to", str(switch),
                   "--switch-at", "3")
    summary = ranks[0]["_summary"]
    assert summary["horovod_ring"] == [horovod_ops[1]]
    assert summary["bridged_passes"] == (3 if horovod_ops[1] else 5) + 3 * (not any(horovod_ops)), summary
    assert summary["overlapped_groups"] == summary["bridged_passes"], summary  # by default: 1 MiB, 1 group
    _assert_close(ranks, _reference(tmp_path_factory, "horovod", "keras-fit", "--steps", "8"), EXACT,
                  "horovod.tensorflow")


# --- the bridge overlapping the backward pass (issue 24 §4) -------------------------------------
ONE_CALL = {"HYBRIDSYNC_TF_OVERLAP_BYTES": "0"}
"""The bridge's graph path as one ``numpy_function`` after the backward pass."""
PER_VARIABLE = {"HYBRIDSYNC_TF_OVERLAP_BYTES": "1"}
"""Each gradient handed to the runtime by a call of its own, as the backward pass produces it."""


@pytest.mark.parametrize("case, api, flags", [
    ("ring", "tape-function", ("--unused",)),   # the ring, a kernel in 2 partitions; a None gradient
    ("mixed", "keras-fit", ()),                 # hierarchical, merged, ps; a sparse gradient
    ("ps_bsp", "tape-function", ()),            # the parameter server, the embedding in 3 shards
])
def test_the_overlapped_bridge_ends_where_one_call_and_horovod_do(case, api, flags, tmp_path, tmp_path_factory):
    """One ``numpy_function`` per variable during the backward pass, then one that waits: the same
    variables as the bridge's single call after the backward pass, and as Horovod's."""
    doc = {"ring": PARTITIONED_RING, "mixed": MIXED, "ps_bsp": PS_BSP}[case]
    argv = _hybridsync_run(_strategy(tmp_path, doc))
    one_call = _train(argv, tmp_path / "one", "hybridsync", api, *flags, env=ONE_CALL)
    overlapped = _train(argv, tmp_path / "overlapped", "hybridsync", api, *flags, env=PER_VARIABLE)
    assert one_call[0]["_summary"]["overlapped_groups"] == 0
    assert overlapped[0]["_summary"]["overlapped_groups"] == 6 * 5  # the model's 5; a None gradient: no call
    assert overlapped[0]["_summary"]["bridged_passes"] == 6
    _assert_close(overlapped, one_call[0], EXACT, "the bridge's single call")
    _assert_close(overlapped, _reference(tmp_path_factory, "horovod", api, *flags), EXACT, "horovod.tensorflow")


def test_keras_backward_passes_per_step_accumulates_as_horovods(tmp_path, tmp_path_factory):
    """Three passes per update, averaged, with Adam (whose bias correction counts ``iterations``): the
    passes in between apply nothing but advance ``iterations``, as in Horovod's Keras optimizer. In
    ``fit`` (a tf.function) and in an eager custom loop."""
    flags = ("--passes", "3", "--average-aggregated", "--optimizer", "adam", "--sparse-as-dense")
    horovod = _reference(tmp_path_factory, "horovod", "keras-fit", *flags)
    assert horovod["_summary"]["iterations"] == 6
    for api in ("keras-fit", "keras-loop"):
        ranks = _train(launcher_argv("horovodrun"), tmp_path / api, "hybridsync", api, *flags)
        _assert_close(ranks, horovod, EXACT, f"horovod's Keras optimizer ({api})")
        assert [r["_summary"]["iterations"] for r in ranks] == [6, 6]


def test_an_eager_loops_tapes_share_one_bridge_and_accumulate_across_steps(tmp_path):
    """An eager loop builds a tape every step: they share one bridge (one torch optimizer, built once:
    before, each step built its own, a collective that made the step ~2.5x Horovod's), so
    ``backward_passes_per_step`` counts across the tapes. Before, every tape's fresh count returned the
    local sums and never synchronized: each rank trained alone. The eager loop ends where the same loop
    in a ``tf.function`` (one bridge, built when traced) ends, rank by rank."""
    flags = ("--passes", "2", "--steps", "6")
    eager = _train(launcher_argv("horovodrun"), tmp_path / "eager", "hybridsync", "tape", *flags)
    assert [r["_summary"]["tape_bridges"] for r in eager] == [1, 1]
    assert eager[0]["_summary"]["bridged_passes"] == 6
    traced = _train(launcher_argv("horovodrun"), tmp_path / "traced", "hybridsync", "tape-function", *flags)
    for rank in (0, 1):  # the passes in between applied each rank's local sums: the ranks differ
        _assert_close(eager[rank:rank + 1], traced[rank], EXACT, f"the tf.function loop's rank {rank}")


def test_sync_switch_policy_with_the_keras_optimizer(tmp_path, tmp_path_factory):
    """``switch``: BSP for 4 steps, then ASP with the learning rate scaled by 1/2 (two workers); the
    loss keeps falling, the ranks agree after the final pull, and ``set_strategy`` gives the user's
    learning rate back."""
    doc = {**PS_BSP, "sync": {"policy": "switch", "switch_at": 4}}
    ranks = _train(_hybridsync_run(_strategy(tmp_path, doc)), tmp_path / "hs", "hybridsync", "keras-fit",
                   "--steps", "12", "--sync-switch-report")
    for rank in ranks:
        summary = rank["_summary"]
        assert summary["switches"] == [[4, "asp"]], summary
        assert summary["lr_at_end"] == pytest.approx(0.025) and summary["lr_after_set_strategy"] == pytest.approx(0.05)
    _assert_close(ranks[1:], ranks[0], 0.0, "rank 0 after the final pull")
    untrained = _reference(tmp_path_factory, "single", "keras-fit", "--steps", "0")
    assert ranks[0]["_summary"]["loss"] < 0.5 * untrained["_summary"]["loss"]


def test_keras_3_works_too(tmp_path, tmp_path_factory):
    keras3 = {"TF_USE_LEGACY_KERAS": "0"}
    for api in ("keras-fit", "tape-function"):
        ranks = _train(_hybridsync_run(_strategy(tmp_path, MIXED)), tmp_path / api, "hybridsync", api, env=keras3)
        assert "ps/bsp:out/bias" in ranks[0]["_summary"]["messages"]
        _assert_close(ranks, _reference(tmp_path_factory, "single", api, env=keras3), EXACT, "the whole batch")


@pytest.mark.parametrize("keras", [2, 3])
def test_mixed_precision_skips_an_overflowing_step_on_every_rank(keras, tmp_path):
    """Rank 0's second batch overflows float16, rank 1's does not (``tf_mixed_precision.py``): the
    loss-scale optimizer skips that step on both ranks, which end equal. Keras 2's, wrapped around
    the optimizer by ``model.compile``, sees the ranks' vote; Keras 3's, which would test each rank
    alone, is refused and named the order that works. A Keras 3 loop calling ``apply`` synchronizes."""
    prefix = tmp_path / "out"
    proc = run_job(launcher_argv("horovodrun") + [sys.executable, str(WORKERS / "tf_mixed_precision.py"),
                                                  str(prefix)],
                   timeout=180, env={**TF_ENV, "TF_USE_LEGACY_KERAS": "1" if keras == 2 else "0"})
    assert proc.returncode == 0, proc.stdout[-4000:]
    ranks = [json.loads((tmp_path / f"out.rank{rank}.json").read_text()) for rank in range(2)]
    if keras == 3:
        for result in ranks:
            assert "LossScaleOptimizer(optimizer)) tests the synchronized" in result.pop("compiled")["error"]
            assert "checksum" in result["apply"]
    else:
        assert ranks[0]["compiled"] == ranks[0]["wrapped_inside"]
        assert ranks[0]["compiled_legacy"]["loss_scale"] == 2.0 ** 14
    assert ranks[0] == ranks[1] and ranks[0]["keras"] == keras
    assert ranks[0]["wrapped_inside"]["loss_scale"] == 2.0 ** 14 and ranks[0]["wrapped_inside"]["finite"]

def test_an_active_profiler_keeps_a_traced_step_on_the_bridge(tmp_path):
    """The profiler is a step hook, and a step hook keeps a graph off Horovod's ops (``options_allow``)
    and on one bridge call (it times the whole backward pass): profiling ``model.fit``'s traced step in
    one process describes every variable with the backward pass timed, then ends the run (exit 0)."""
    from hybridsync.description import load_description
    description = tmp_path / "model.json"
    env = {**TF_ENV, "HYBRIDSYNC_PROFILE": str(description), "HYBRIDSYNC_PROFILE_STEPS": "2",
           "HYBRIDSYNC_PROFILE_WARMUP": "1"}
    proc = run_job([sys.executable, str(TRAIN), str(tmp_path / "hs"), "--impl", "hybridsync", "--api", "keras-fit"],
                   timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:]
    model = load_description(description)
    assert set(model.variables) == {"embedding/embeddings", "hidden/kernel", "hidden/bias", "out/kernel", "out/bias"}
    assert model.timing is not None and model.timing.backward_s > 0
    assert not (tmp_path / "hs.rank0.json").exists(), "the run went on after the profile (6 steps, not 3)"


# --- errors ------------------------------------------------------------------------------------
def test_bad_inputs_get_clear_errors(tmp_path):
    out = tmp_path / "errors.json"
    proc = run_job([sys.executable, str(WORKERS / "tf_errors.py"), str(out)], timeout=120, env=TF_ENV)
    assert proc.returncode == 0, proc.stdout[-4000:]
    errors = json.loads(out.read_text())
    expected = {
        "unknown_variable": "dense/nope",
        "bad_strategy_key": "carrier-pigeon",
        "tape_asp": "hybridsync.tensorflow.keras.DistributedOptimizer",
        "dynamic_sync": "static protocol",
        "op_adasum": "Average or Sum",
        "predivide_with_sum": "gradient_predivide_factor",
        "passes_zero": "backward_passes_per_step must be > 0",
        "keras_passes_zero": "backward_passes_per_step must be > 0",
        "keras_switch_with_schedule": "ExponentialDecay",
        "keras_switch_momentum_scale": "momentum_scale",
        "integer_variable": "counter",
        "missing_strategy_file": "/nonexistent/strategy.json",
        "rows": "dense/kernel have `rows`, which the TensorFlow front end does not support",
        "compression_by_name": "compression must be a compressor",
    }
    for case, words in expected.items():
        kind = "TypeError" if case == "compression_by_name" else "ValueError"
        assert errors[case].startswith(kind) and words in errors[case], (case, errors[case])
    # One rank: Horovod skips its collectives, and so does the bridge; the weights are plain Keras'.
    assert errors["size_one"] == {"passthrough": [True], "max_difference": 0.0}, errors["size_one"]


def test_ranks_that_disagree_on_the_strategy_fail_at_once(tmp_path):
    proc = run_job(launcher_argv("horovodrun") + [sys.executable, str(WORKERS / "tf_errors.py"),
                                                  str(tmp_path / "out"), "--disagree"], timeout=120, env=TF_ENV)
    assert proc.returncode == 0, proc.stdout[-4000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert "ranks disagree" in result["error"] and result["seconds"] < 30, result
