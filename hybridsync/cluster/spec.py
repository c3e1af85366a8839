"""``ClusterSpec``: the shape of a (real or emulated) multi-node cluster, loaded from YAML.

A spec file looks like this::

    nodes: 2                      # hosts
    workers_per_node: 2           # training ranks per host
    inter_node_bandwidth: 1gbit   # each host's uplink, tc-style: <number><kbit|mbit|gbit>
    inter_node_latency_ms: 0      # one-way host-to-host delay (needs the kernel's sch_netem)
    servers_per_node: 0           # parameter-server processes per host

Bandwidth is written the way ``tc`` writes rates: a decimal number followed by ``kbit``,
``mbit`` or ``gbit`` (bits per second, SI multiples: ``1gbit`` = 10**9 bit/s), case-insensitive.
The file may hold the spec at top level, under a ``cluster:`` key, or under
``hybridsync: cluster:`` in a horovodrun ``--config-file`` (see ``horovodrun_configs/``).

Every user mistake is reported at once as a ``ValueError`` naming each bad field.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

BANDWIDTH_UNITS: dict[str, int] = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_BANDWIDTH_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(kbit|mbit|gbit)\s*$", re.IGNORECASE)
SUBNET_PREFIX = "10.77.0."
"""Node i gets ``10.77.0.<i+1>/24``; the subnet only exists inside the cluster's namespaces."""
SUBNET_MASK_BITS = 24
MAX_NODES = 250


def parse_bandwidth(text: str) -> int:
    """Bits per second of a tc-style rate such as ``"1gbit"`` or ``"100mbit"``.

    Raises ``ValueError`` for anything else (bare numbers are refused: their unit is ambiguous).
    """
    if not isinstance(text, str):
        raise ValueError(f"bandwidth must be a string like '1gbit' or '100mbit', got {text!r}")
    match = _BANDWIDTH_RE.match(text)
    if match is None:
        raise ValueError(f"bandwidth {text!r} is not <number><kbit|mbit|gbit>, e.g. '1gbit'")
    bits = float(match.group(1)) * BANDWIDTH_UNITS[match.group(2).lower()]
    if bits < 1000:
        raise ValueError(f"bandwidth {text!r} is below 1kbit")
    return int(bits)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A cluster of identical nodes joined by identical (shaped) uplinks."""

    nodes: int
    """Number of hosts."""
    workers_per_node: int
    """Training ranks per host."""
    inter_node_bandwidth: str
    """Each host's uplink rate, tc-style (``"1gbit"``, ``"100mbit"``); both directions."""
    inter_node_latency_ms: float = 0.0
    """One-way host-to-host delay in milliseconds (half on each end of the path; RTT is 2x)."""
    servers_per_node: int = 0
    """Parameter-server processes per host (0: no PS route)."""

    def __post_init__(self) -> None:
        errors = _field_errors(dataclasses.asdict(self))
        if errors:
            raise ValueError("invalid cluster spec: " + "; ".join(errors))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ClusterSpec":
        """Builds a spec from a mapping, refusing unknown keys and bad values all at once."""
        if not isinstance(data, Mapping):
            raise ValueError(f"cluster spec must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        errors = [f"unknown key {key!r} (known: {', '.join(f.name for f in dataclasses.fields(cls))})"
                  for key in sorted(set(data) - known, key=str)]
        errors += [f"missing required key {key!r}" for key in sorted(required - set(data))]
        errors += _field_errors({k: v for k, v in data.items() if k in known})
        if errors:
            raise ValueError("invalid cluster spec: " + "; ".join(errors))
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> "ClusterSpec":
        """Loads a spec file: the spec at top level, under ``cluster:``, or under
        ``hybridsync: cluster:`` (a horovodrun ``--config-file``, which ignores that section)."""
        import yaml

        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
        if isinstance(data, Mapping) and isinstance(data.get("hybridsync"), Mapping):
            data = data["hybridsync"]  # a horovodrun --config-file with a hybridsync: section
        if isinstance(data, Mapping) and "cluster" in data:
            data = data["cluster"]
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{os.fspath(path)}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        """The document form, suitable for ``yaml.safe_dump``."""
        return dataclasses.asdict(self)

    @property
    def num_workers(self) -> int:
        """Training ranks in the whole cluster."""
        return self.nodes * self.workers_per_node

    @property
    def num_servers(self) -> int:
        """Parameter-server processes in the whole cluster."""
        return self.nodes * self.servers_per_node

    @property
    def hierarchical_is_ring(self) -> bool:
        """One rank per node: hierarchical all-reduce is then one all-reduce over the job, which the
        runtime sends as the ring all-reduce (``backends.make_backend``). (One node of several ranks
        sums through shared memory: another transport, not the ring.)"""
        return self.workers_per_node == 1

    @property
    def inter_node_bits_per_second(self) -> int:
        """The uplink rate in bit/s."""
        return parse_bandwidth(self.inter_node_bandwidth)

    @property
    def inter_node_bytes_per_second(self) -> float:
        """The uplink rate in byte/s (what the cost model's beta terms use)."""
        return self.inter_node_bits_per_second / 8

    @property
    def node_ips(self) -> tuple[str, ...]:
        """Each node's address on the cluster's private subnet (node i -> 10.77.0.<i+1>)."""
        return tuple(f"{SUBNET_PREFIX}{index + 1}" for index in range(self.nodes))

    @property
    def horovod_hosts(self) -> str:
        """The ``-H`` argument of horovodrun/mpirun for this cluster, e.g. ``10.77.0.1:2,10.77.0.2:2``."""
        return ",".join(f"{ip}:{self.workers_per_node}" for ip in self.node_ips)


def _field_errors(values: Mapping[str, Any]) -> list[str]:
    """Every problem among the given field values (fields absent from ``values`` are skipped)."""
    errors: list[str] = []
    checks = {
        "nodes": lambda v: _is_int(v) and 1 <= v <= MAX_NODES,
        "workers_per_node": lambda v: _is_int(v) and v >= 1,
        "servers_per_node": lambda v: _is_int(v) and v >= 0,
        "inter_node_latency_ms": lambda v: _is_number(v) and 0 <= v <= 10_000,
    }
    expected = {
        "nodes": f"an integer in [1, {MAX_NODES}]",
        "workers_per_node": "an integer >= 1",
        "servers_per_node": "an integer >= 0",
        "inter_node_latency_ms": "a number of milliseconds in [0, 10000]",
    }
    for name, ok in checks.items():
        if name in values and not ok(values[name]):
            errors.append(f"{name} must be {expected[name]}, got {values[name]!r}")
            if name == "workers_per_node" and isinstance(values[name], (list, tuple, Mapping)):
                errors[-1] += (" (a spec's nodes hold equal numbers of workers, as hierarchical all-reduce "
                               "needs: uneven hosts cannot be described)")
    if "inter_node_bandwidth" in values:
        try:
            parse_bandwidth(values["inter_node_bandwidth"])
        except ValueError as error:
            errors.append(f"inter_node_bandwidth: {error}")
    return errors
