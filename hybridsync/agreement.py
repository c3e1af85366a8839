"""What the ranks compare before they synchronize anything, so that a difference fails on every
rank at once, naming it, instead of leaving some rank waiting forever for a collective the
others never start.

At optimizer construction and at every ``set_strategy`` the ranks (of the optimizer's process
set) exchange one record each, in one Horovod all-gather: the fingerprints of the strategy
and the routing plan, how many plans the process built before (their keys' namespaces), a
hash of the parameters that do not require a gradient (a parameter frozen on one rank only
is synchronized by the others alone), and the optimizer's arguments that change what is sent
(``backward_passes_per_step``, the reduction, ``sparse_as_dense``, the compression). The
first optimizer of the job also carries rank 0's offer of the stall board
(``backends.stalls``). Only when the hashes of frozen parameters differ does a second
all-gather bring the names, to say which. Waits are watched (``backends.waiting``): a rank
that never comes to the comparison while the others wait is named.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Sequence

import torch

from hybridsync import envvars
from hybridsync.backends import stalls
from hybridsync.backends.waiting import wait

_LENGTH_DIGITS = 10
"""Each gathered record is prefixed by its length in this many ASCII digits."""
_SHOWN = 8
"""Parameters named in a message, at most."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RankFacts:
    """What one rank's optimizer must have in common with every other rank's."""

    strategy: str
    """Fingerprint of the strategy (``groups`` applied)."""
    plan: str
    """Fingerprint of the routing plan."""
    instance: int
    """Plans built in this process before this one (``Router.instance``): names the PS keys."""
    frozen: tuple[str, ...]
    """Names of the optimizer's parameters that do not require a gradient now."""
    settings: dict[str, Any]
    """The optimizer's arguments that change what is sent, by name."""


def check_ranks_agree(hvd: Any, facts: RankFacts, process_set: Any, *, switching: bool = False,
                      elastic: bool = False) -> int:
    """``ValueError`` on every rank of ``process_set`` if any two of them differ in ``facts``;
    returns the plan number (``facts.instance``) they agree on.

    Collective over ``process_set``. ``switching``: called by ``set_strategy`` (the plan being
    replaced is ``facts.instance``), whose message says the previous strategy stays in force.
    ``elastic``: in an elastic job a worker that joined has built fewer plans than the others, so
    the numbers may differ and the largest serves every rank; the stall watch, whose board lives
    on the first world's rank 0, is not offered there.
    """
    global_set = process_set is hvd.global_process_set or getattr(process_set, "process_set_id", 0) == 0
    offer = stalls.host_board(hvd.rank(), hvd.size()) if global_set and hvd.rank() == 0 and not elastic else None
    mine = {"strategy": facts.strategy, "plan": facts.plan, "instance": facts.instance,
            "frozen": _digest(facts.frozen), "settings": facts.settings, "board": offer}
    stalls.where = ("set_strategy" if switching else "build", facts.instance)
    try:
        everyone = gather_records(hvd, mine, process_set, "hybridsync.agreement")
        if global_set and hvd.rank() != 0 and not elastic:
            stalls.accept_board(everyone[0]["board"], hvd.rank(), hvd.size())
        ranks = list(process_set.ranks or range(len(everyone)))
        problems = [_strategy_problem(everyone, ranks, switching, elastic), _settings_problem(everyone, ranks)]
        if len({record["frozen"] for record in everyone}) > 1:
            frozen = gather_records(hvd, {"frozen": list(facts.frozen)}, process_set, "hybridsync.agreement.frozen")
            problems.append(_frozen_problem([set(record["frozen"]) for record in frozen], ranks, switching))
    finally:
        stalls.where = None
    problems = [p for p in problems if p]
    if problems:
        if switching:
            problems.append("The previous strategy stays in force.")
        raise ValueError(" ".join(problems))
    return max(record["instance"] for record in everyone)


def gather_records(hvd: Any, record: dict[str, Any], process_set: Any, name: str) -> list[dict[str, Any]]:
    """Every rank's ``record`` (JSON-able) within ``process_set``, in rank order: one all-gather of
    length-prefixed bytes (``hvd.allgather_object`` has no process set)."""
    data = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    framed = bytearray(f"{len(data):0{_LENGTH_DIGITS}d}".encode() + data)
    handle = hvd.allgather_async(torch.frombuffer(framed, dtype=torch.uint8), name=name, process_set=process_set)
    gathered = wait(hvd, handle).numpy().tobytes()
    records, at = [], 0
    while at < len(gathered):
        length = int(gathered[at:at + _LENGTH_DIGITS])
        at += _LENGTH_DIGITS
        records.append(json.loads(gathered[at:at + length]))
        at += length
    return records


def _digest(names: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


def _strategy_problem(everyone: list[dict[str, Any]], ranks: list[int], switching: bool, elastic: bool) -> str:
    keys = [(r["strategy"], r["plan"], r["instance"]) for r in everyone]
    if len({key[:2] if elastic else key for key in keys}) == 1:
        return ""
    table = "; ".join(f"rank {rank}: strategy {s}, plan {p}, optimizer #{i}" for rank, (s, p, i) in zip(ranks, keys))
    if switching:
        return (f"ranks disagree on the strategy passed to set_strategy() ({table}); every rank must call "
                f"set_strategy() with the same strategy at the same step.")
    if len({s for s, _, _ in keys}) == 1 and len({i for _, _, i in keys}) == 1:
        return (f"ranks disagree on the synchronization strategy ({table}): the same strategy gives the ranks "
                f"different routing plans, so their models differ (parameter names, shapes or dtypes). Every "
                f"rank must build the same model.")
    return (f"ranks disagree on the synchronization strategy ({table}). Every rank must load the same strategy "
            f"file ({envvars.STRATEGY}={os.environ.get(envvars.STRATEGY)!r} here), build the same model and "
            f"create the same DistributedOptimizers in the same order.")


def _settings_problem(everyone: list[dict[str, Any]], ranks: list[int]) -> str:
    differing = []
    for key in sorted({key for record in everyone for key in record["settings"]}):
        values: dict[str, list[int]] = {}
        for rank, record in zip(ranks, everyone):
            values.setdefault(json.dumps(record["settings"].get(key)), []).append(rank)
        if len(values) > 1:
            differing.append(f"{key} is " + ", ".join(f"{value} on {_ranks(on)}" for value, on in values.items()))
    if not differing:
        return ""
    return (f"ranks disagree on the DistributedOptimizer's arguments: {'; '.join(differing)}. Every rank must "
            f"pass the same ones.")


def _frozen_problem(frozen: list[set[str]], ranks: list[int], switching: bool) -> str:
    names = sorted(set().union(*frozen) - set.intersection(*frozen))
    lines = [f"{name} (frozen on {_ranks([r for r, f in zip(ranks, frozen) if name in f])}, trained on "
             f"{_ranks([r for r, f in zip(ranks, frozen) if name not in f])})" for name in names[:_SHOWN]]
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    when = "call set_strategy()" if switching else "build the optimizer"
    return (f"ranks disagree on which parameters require a gradient: {', '.join(lines)}{more}. A parameter that "
            f"requires a gradient on some ranks only would be synchronized by those ranks alone, which wait "
            f"forever; set requires_grad the same way on every rank before they {when}.")


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
