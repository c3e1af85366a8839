"""2-rank runs under horovodrun (Gloo) and mpirun: hybridsync == Horovod, and clear errors."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import WORKERS, launcher_argv, rank_results, run_job

sys.path.insert(0, str(WORKERS))
from equivalence import CASES  # noqa: E402
from errors import CASES as ERROR_CASES  # noqa: E402

_cache: dict[str, dict] = {}


def equivalence_results(launcher: str, tmp_path_factory) -> dict:
    """One job per launcher runs every case; the tests below read its results."""
    if launcher not in _cache:
        out = tmp_path_factory.mktemp(launcher) / "eq.json"
        proc = run_job(launcher_argv(launcher) + [sys.executable, str(WORKERS / "equivalence.py"), str(out)])
        assert proc.returncode == 0 and out.exists(), proc.stdout[-4000:]
        _cache[launcher] = json.loads(out.read_text())
    return _cache[launcher]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.multiprocess
def test_parameters_equal_horovod(launcher, case, tmp_path_factory):
    result = equivalence_results(launcher, tmp_path_factory)[case]
    assert result["moved"] > 1e-3, "training did not change the parameters; the comparison would be vacuous"
    assert result["max_abs_diff"] <= result["tolerance"], result


@pytest.mark.multiprocess
def test_world_has_two_ranks(launcher, tmp_path_factory):
    assert equivalence_results(launcher, tmp_path_factory)["_world"]["size"] == 2


def error_results(launcher: str, tmp_path_factory) -> list[dict]:
    return rank_results(launcher, "errors.py", tmp_path_factory, timeout=120)


EXPECTED_ERRORS = {
    "fingerprint_mismatch": ("ValueError", "ranks disagree on the synchronization strategy"),
    "unknown_variable": ("ValueError", "'missing.weight' is not in the model"),
    "strategy_for_the_unwrapped_model": ("ValueError", "variable 'encoder.weight' is not in the model; did "
                                                       "you mean 'module.encoder.weight'?"),
    "two_optimizers_share_a_strategy": (None, "no error"),
    "strategy_names_an_earlier_models_variable": ("ValueError", "variable 'earlier_only.weight' is not in the model"),
    "bad_value": ("ValueError", "partitions must be an integer >= 1"),
    "too_many_partitions": ("ValueError", "partitions 5 exceeds its 2 rows"),
    "missing_file": ("ValueError", "cannot read strategy file '/nonexistent/strategy.json'"),
    "strategy_from_environment": ("ValueError", "'nope.weight' is not in the model"),
    "ps_without_servers": ("RouteUnavailableError", "DMLC_NUM_SERVER is not set"),
    "ps_worker_count_mismatch": ("RouteUnavailableError", "DMLC_NUM_WORKER=3 but the Horovod job has 2 ranks"),
    "hierarchical_after_plain_hvd_init": (None, "no error"),
    "duplicate_names": ("ValueError", "Found duplicates: w"),
    "wrapped_twice": ("ValueError", "is a DistributedOptimizer already (horovod.torch's)"),
    "strategy_names_a_tied_alias": ("ValueError", "variable 'decoder.weight' is the same parameter as "
                                                  "'embed.weight' (tied weights are one variable"),
    "strategy_names_a_group_added_later": (None, "no error"),
    "predivide_with_sum": ("ValueError", "gradient_predivide_factor not supported"),
    "compression_by_name": ("TypeError", "compression must be a compressor such as hybridsync.Compression.fp16"),
    "zero_grad_before_step": ("AssertionError", "zero_grad() was called after loss.backward()"),
    "frozen_on_one_rank": ("ValueError", "ranks disagree on which parameters require a gradient: 0.bias "
                                         "(frozen on rank 1, trained on rank 0)"),
    "backward_passes_differ": ("ValueError", "backward_passes_per_step is 1 on rank 0, 2 on rank 1"),
    "sparse_on_one_rank": ("ValueError", "ranks disagree on which gradients are sparse: 0.weight (sparse on "
                                         "ranks [0], dense on ranks [1])"),
    "too_many_backward_passes": ("AssertionError", "more than backward_passes_per_step"),
    "complex_on_the_ring": ("ValueError", "complex parameters cannot be ring all-reduced (Horovod refuses complex "
                                          "tensors): 'spectral' (complex64); route them"),
    "complex_routed_hierarchical_or_frozen": (None, "no error"),
    "model_differs_on_one_rank": ("ValueError", "the same strategy gives the ranks different routing plans, so "
                                                "their models differ (parameter names, shapes or dtypes)"),
}


@pytest.mark.unit
def test_every_error_case_is_checked():
    assert set(EXPECTED_ERRORS) == set(ERROR_CASES)


@pytest.mark.parametrize("case", sorted(EXPECTED_ERRORS))
@pytest.mark.multiprocess
def test_clear_error_on_every_rank(launcher, case, tmp_path_factory):
    kind, text = EXPECTED_ERRORS[case]
    for rank, results in enumerate(error_results(launcher, tmp_path_factory)):
        outcome = results[case]
        assert outcome["type"] == kind, f"rank {rank}: {outcome}"
        assert text in outcome["message"], f"rank {rank}: {outcome['message']}"
        assert outcome["seconds"] < 10, f"rank {rank} took {outcome['seconds']}s to fail"


@pytest.mark.multiprocess
def test_bad_value_names_every_culprit(tmp_path_factory):
    message = error_results("horovodrun", tmp_path_factory)[0]["bad_value"]["message"]
    assert "compression 'int3' is not one of none, fp16" in message
