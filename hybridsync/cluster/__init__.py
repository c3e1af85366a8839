"""Cluster descriptions and the emulated multi-node cluster (hosts as network namespaces)."""
from hybridsync.cluster.spec import ClusterSpec, parse_bandwidth

__all__ = ["ClusterSpec", "parse_bandwidth", "EmulatedCluster", "leftovers"]


def __getattr__(name: str):
    # netns pulls in subprocess/signal machinery; keep `import hybridsync.cluster` light.
    if name in ("EmulatedCluster", "leftovers"):
        from hybridsync.cluster import netns

        return getattr(netns, name)
    raise AttributeError(name)
