"""What Horovod v0.28.1's optimizer tests check, on hybridsync's optimizer, under horovodrun and mpirun.

Each case of ``workers/horovod_contract.py`` mirrors one or more of Horovod's tests in
``test/parallel/test_torch.py`` (broadcast_state, broadcast_state_options,
broadcast_state_no_grad, force_allreduce, duplicate_names, missing_named_parameters,
no_named_parameters, dynamic_requires_grad, gradient_clipping, synchronize_step_warning,
sparse_embeddings, optimizer_process_sets) plus groups/num_groups; where it makes sense
it compares the parameters with ``horovod.torch.DistributedOptimizer``'s.
"""
from __future__ import annotations

import sys

import pytest

from conftest import WORKERS, rank_results

sys.path.insert(0, str(WORKERS))
from horovod_contract import CASES  # noqa: E402

pytestmark = pytest.mark.multiprocess


def contract_results(launcher: str, tmp_path_factory) -> list[dict]:
    """One job per launcher runs every case (each bounded inside the job); tests read its results."""
    return rank_results(launcher, "horovod_contract.py", tmp_path_factory, timeout=300)


@pytest.mark.parametrize("case", sorted(CASES))
def test_horovod_optimizer_contract(launcher, case, tmp_path_factory):
    for rank, results in enumerate(contract_results(launcher, tmp_path_factory)):
        assert results[case] == "ok", f"rank {rank}: {results[case]}"
