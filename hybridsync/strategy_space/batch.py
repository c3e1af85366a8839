"""Strategies as arrays: ``StrategyBatch``, N candidate strategies of one model at once.

A search that scores 10,000 candidates a second cannot build ``Strategy`` objects for them:
the sampler, the repair, the search's operators and the simulator all work on (candidates x
variables) arrays, one per knob of ``hybridsync.knobs`` (a choice knob as its code: its index
in the knob's choices). ``to_strategy`` turns a candidate back into a ``Strategy``; the
simulator's ``model.encoding.from_strategies`` goes the other way.

The variables are known to these arrays by ``VariableArrays``: their names and sizes, no
timing, so that trials draw strategies for a plain model description as the search does for a
profiled one (``model.encoding.ModelArrays`` is one). Torch-free; numpy only.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

import numpy as np

from hybridsync import knobs
from hybridsync.description import FLOATING_DTYPES, VariableInfo
from hybridsync.strategy import Strategy, VarConfig

ROUTE_VARIANTS: tuple[tuple[str, str | None], ...] = (
    *(("allreduce", algorithm) for algorithm in knobs.ALGORITHM.choices), ("ps", None))
"""``StrategyBatch.route`` codes: (route, algorithm) of each all-reduce algorithm, then the
parameter servers (whose protocol is an array of its own)."""
RING = ROUTE_VARIANTS.index(("allreduce", "ring"))
HIER = ROUTE_VARIANTS.index(("allreduce", "hierarchical"))
PS = ROUTE_VARIANTS.index(("ps", None))
BSP, SSP = knobs.PROTOCOL.code("bsp"), knobs.PROTOCOL.code("ssp")
FP16 = knobs.COMPRESSION.code("fp16")
"""``StrategyBatch.fp16`` is true where a variable's compression has this code."""
MAX_KIND_STALENESS = 1023
"""Stalenesses above this share a message kind (``message_kind``)."""
MESSAGE_KINDS = len(ROUTE_VARIANTS) * len(knobs.PROTOCOL.choices) * 2 * (MAX_KIND_STALENESS + 1)
"""``message_kind`` is below this."""


class VariableArrays(Protocol):
    """A model's variables as per-variable arrays (the description's variable order)."""

    @property
    def names(self) -> tuple[str, ...]: ...

    @property
    def nbytes(self) -> np.ndarray:
        """Dense gradient bytes."""

    @property
    def rows(self) -> np.ndarray:
        """Rows along dim 0 (1 for scalars): the most shards a variable can have."""

    @property
    def floating(self) -> np.ndarray:
        """Whether fp16 compression casts the variable."""

    @property
    def sparse(self) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlainVariables:
    """``VariableArrays`` of a plain model description (no timing)."""

    names: tuple[str, ...]
    nbytes: np.ndarray
    rows: np.ndarray
    floating: np.ndarray
    sparse: np.ndarray

    @property
    def num_variables(self) -> int:
        return len(self.names)


def variable_arrays(variables: Mapping[str, VariableInfo]) -> PlainVariables:
    """The arrays of ``variables`` (in their order)."""
    infos = list(variables.values())
    return PlainVariables(names=tuple(variables), nbytes=np.array([info.nbytes for info in infos], dtype=np.float64),
                          rows=np.array([info.shape[0] if info.shape else 1 for info in infos], dtype=np.int64),
                          floating=np.array([info.dtype in FLOATING_DTYPES for info in infos], dtype=bool),
                          sparse=np.array([info.sparse for info in infos], dtype=bool))


@dataclasses.dataclass(frozen=True, kw_only=True)
class StrategyBatch:
    """N candidate strategies of one model as (N, V) arrays, V = the model's variables in order."""

    route: np.ndarray
    """int8 ``ROUTE_VARIANTS`` code: 0 all-reduce ring, 1 all-reduce hierarchical, 2 parameter server."""
    protocol: np.ndarray
    """int8 ``knobs.PROTOCOL`` code: 0 bsp, 1 asp, 2 ssp (parameter server only)."""
    staleness: np.ndarray
    """int: steps a worker may run ahead under ssp (else 0)."""
    partitions: np.ndarray
    """int: shards along dim 0 (>= 1)."""
    group: np.ndarray
    """int: merge group, numbered 0..G-1 within each candidate; -1 for none."""
    fp16: np.ndarray
    """bool: the variable travels as float16 (its compression, or the optimizer's default)."""
    server_share: np.ndarray
    """(N, V, S) float: fraction of the variable's bytes the strategy places on each server
    explicitly (all zero: balanced by bytes). S = the cluster's servers (at least 1 column)."""
    rows: np.ndarray | None = None
    """bool: the dense gradient travels as its nonzero rows (``VarConfig.rows``); ``None``: nowhere."""

    def __post_init__(self) -> None:
        shape = self.route.shape
        if self.rows is None:
            object.__setattr__(self, "rows", np.zeros(shape, bool))
        if len(shape) != 2 or any(getattr(self, f).shape != shape
                                  for f in ("protocol", "staleness", "partitions", "group", "fp16", "rows")):
            raise ValueError(f"StrategyBatch arrays must all have shape (candidates, variables), got route {shape}")
        if self.server_share.shape[:2] != shape:
            raise ValueError(f"server_share must have shape {shape + ('servers',)}, got {self.server_share.shape}")

    def __len__(self) -> int:
        return self.route.shape[0]

    def take(self, indices: np.ndarray | Sequence[int]) -> "StrategyBatch":
        """The candidates at ``indices`` (a search's survivors), as a new batch."""
        return StrategyBatch(**{f.name: getattr(self, f.name)[np.asarray(indices)] for f in dataclasses.fields(self)})

    @classmethod
    def concatenate(cls, batches: Sequence["StrategyBatch"]) -> "StrategyBatch":
        """One batch of the candidates of ``batches`` (of one model and cluster), in order."""
        if not batches:
            raise ValueError("StrategyBatch.concatenate: no batches")
        return cls(**{f.name: np.concatenate([getattr(b, f.name) for b in batches]) for f in dataclasses.fields(cls)})

    def to_strategy(self, index: int, names: Sequence[str]) -> Strategy:
        """Candidate ``index`` as a ``Strategy`` (explicit servers as the shards' shares say)."""
        configs = {}
        for v, name in enumerate(names):
            parts, group = int(self.partitions[index, v]), int(self.group[index, v])
            common = dict(partitions=parts, group=None if group < 0 else group,
                          compression=knobs.COMPRESSION.choices[FP16] if self.fp16[index, v] else None)
            route, algorithm = ROUTE_VARIANTS[int(self.route[index, v])]
            if route == "ps":
                protocol = knobs.PROTOCOL.choices[int(self.protocol[index, v])]
                share = self.server_share[index, v]
                servers = _shard_servers(share, parts) if share.sum() > 0 else None
                staleness = int(self.staleness[index, v]) if protocol == "ssp" else None
                configs[name] = VarConfig(route="ps", protocol=protocol, staleness=staleness, servers=servers,
                                          rows=bool(self.rows[index, v]), **common)
            else:
                configs[name] = VarConfig(route="allreduce", algorithm=algorithm, rows=bool(self.rows[index, v]),
                                          **common)
        return Strategy(variables=configs)


def empty_batch(n: int, num_variables: int, num_servers: int) -> StrategyBatch:
    """``n`` plain-Horovod candidates (every variable ring, one message each)."""
    return StrategyBatch(route=np.full((n, num_variables), RING, np.int8),
                         protocol=np.zeros((n, num_variables), np.int8),
                         staleness=np.zeros((n, num_variables), np.int64),
                         partitions=np.ones((n, num_variables), np.int64),
                         group=np.full((n, num_variables), -1, np.int64), fp16=np.zeros((n, num_variables), bool),
                         server_share=np.zeros((n, num_variables, max(num_servers, 1))))


def copy_batch(batch: StrategyBatch) -> StrategyBatch:
    """A batch whose arrays the operators may change in place."""
    return batch.take(np.arange(len(batch)))


def message_kind(batch: StrategyBatch) -> np.ndarray:
    """An integer per (candidate, variable): equal exactly when two variables may share a message
    (route, algorithm or protocol, compression, staleness: ``VarConfig.message_key``)."""
    staleness = np.minimum(batch.staleness, MAX_KIND_STALENESS)
    route_protocol = batch.route.astype(np.int64) * len(knobs.PROTOCOL.choices) + batch.protocol
    return (route_protocol * 2 + batch.fp16) * (MAX_KIND_STALENESS + 1) + staleness


def _shard_servers(share: np.ndarray, partitions: int) -> tuple[int, ...]:
    """Servers of ``partitions`` shards whose bytes split as ``share`` says (largest remainders)."""
    counts = np.floor(share * partitions).astype(int)
    for s in np.argsort(-(share * partitions - counts), kind="stable")[:partitions - counts.sum()]:
        counts[s] += 1
    return tuple(int(s) for s, count in enumerate(counts) for _ in range(count))
