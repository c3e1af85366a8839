"""Hierarchical all-reduce: within a node, across nodes, within the node again.

``allreduce`` is the backend the router uses; the rest is what it is built from: the
node layout (``layout``), the two Gloo groups it creates when a plan first uses the route
(``groups``), a message as one flat buffer split into per-rank slices (``flat_buffers``),
and the shared-memory intra-node transport (``node_memory``, ``shm``).
"""
from hybridsync.backends.hierarchical.allreduce import HierarchicalAllreduce

__all__ = ["HierarchicalAllreduce"]
