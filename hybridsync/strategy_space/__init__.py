"""The strategy space (toolchain; torch-free): what trials sample and the search explores.

- ``batch.py``: ``StrategyBatch``, candidate strategies as (candidates x variables) arrays, one
  per knob of ``hybridsync.knobs``, and their way back to ``Strategy`` objects;
- ``bounds.py``: ``SpaceBounds``, what a cluster allows (servers, hierarchical all-reduce,
  partitions, sparse gradients made dense or not, exact numerics, server memory);
- ``sample.py``: the one sampler (``sample`` for a batch, ``random_strategy`` for one);
- ``repair.py``: the nearest candidates within the bounds, merge groups in canonical form.

The search's moves (mutation, crossover) are in ``hybridsync.search.operators``; the
simulator's encoding of strategies for a cluster in ``hybridsync.model.encoding``.
"""
from hybridsync.strategy_space.batch import (HIER, PS, RING, PlainVariables, StrategyBatch, VariableArrays,
                                             copy_batch, empty_batch, variable_arrays)
from hybridsync.strategy_space.bounds import MAX_PARTITIONS, SpaceBounds, bounds_for
from hybridsync.strategy_space.repair import canonical_groups, repair
from hybridsync.strategy_space.sample import (BY_CLASS, CLASSES, LARGE_DENSE_BYTES, ROWS_SHARE, is_embedding_like,
                                              random_strategy, sample, variable_class, variable_classes)

__all__ = ["BY_CLASS", "CLASSES", "HIER", "LARGE_DENSE_BYTES", "MAX_PARTITIONS", "PS", "PlainVariables", "RING",
           "ROWS_SHARE", "SpaceBounds", "StrategyBatch", "VariableArrays", "bounds_for", "canonical_groups",
           "copy_batch", "empty_batch", "is_embedding_like", "random_strategy", "repair", "sample", "variable_arrays",
           "variable_class", "variable_classes"]
