"""Search over the strategy space: the space and its random sampler (``space``), batch operators
and repair (``operators``), the evolutionary search (``evolution``) and library searchers for
comparison (``external``)."""
