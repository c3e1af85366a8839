"""Search over the strategy space (``hybridsync.strategy_space``, which trials sample too): batch
operators and repair (``operators``), the evolutionary search (``evolution``) and library
searchers for comparison (``external``)."""
