"""Held-out evaluation fitted in forked worker processes (``cross_validate(workers=)``)."""
from __future__ import annotations

import numpy as np
import pytest

from hybridsync.model.analytic import CostConstants
from hybridsync.model.evaluate import cross_validate
from test_simulator import FAST_PARAMS, synthetic_samples

pytestmark = pytest.mark.multiprocess


def test_held_out_sets_fitted_in_parallel_give_the_same_rows():
    samples = synthetic_samples(seed=7)[::3]
    kwargs = dict(split="model", kinds=("analytic", "both"), constants=CostConstants(cores=2), params=FAST_PARAMS)
    serial = cross_validate(samples, **kwargs)
    parallel = cross_validate(samples, workers=2, **kwargs)
    assert [(r.held_out, r.kind) for r in parallel] == [(r.held_out, r.kind) for r in serial]
    assert all(np.array_equal(p.predicted, s.predicted) for p, s in zip(parallel, serial))
    with pytest.raises(ValueError, match="workers"):
        cross_validate(samples, workers=0, **kwargs)
