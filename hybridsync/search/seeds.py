"""Structured seeds: the strategies a careful engineer tries first, derived from the model description.

The baselines (``hybridsync.baselines``) are global recipes: one route for every variable.
Someone tuning by hand does better by treating each *class* of variable on its own (the
classes of ``strategy_space.variable_class``: sparse, large dense, small dense):

- sparse (embedding) gradients whole on the parameter servers, where only the touched rows
  travel (or the alternatives: Horovod's sparse all-gather, or sharded over the servers);
- dense gradients hierarchically all-reduced in one merged message, the largest layer in a
  message of its own so that it starts as soon as it is ready;
- the same with fp16 on the dense gradients, and the dense ring all-reduce fused with fp16;
- dense gradients merged in two (or, with fp16, four) messages of about equal bytes by backward
  order (PyTorch DDP's buckets), so the last layers' messages overlap the rest of the backward pass;
- per-class mixes: small dense fused on one route, large dense on another (or on the PS);
- dense embedding-like gradients (``nn.Embedding(sparse=False)``: large, and a profiled step
  touches under ``strategy_space.ROWS_SHARE`` of their rows, ``rows_touched``) sent as their nonzero rows
  (``VarConfig.rows``) on the PS or Horovod's sparse all-gather, the other dense gradients merged
  hierarchical (or, beside the all-gather, in two or four messages by backward order), with fp16
  as in the best seeds and without (rows are lossless: ``exact`` keeps those). Which variables those are
  comes from the measured rows only: without them (an unprofiled description) these recipes give
  the others' strategies.

``structured_seeds`` builds these from the variables' classes only (never from a model's
name), within the cluster's ``SpaceBounds``: the hierarchical route becomes ring with one
rank per node, the PS route the all-gather without servers, and ``exact`` drops the fp16
seeds. They enter the autotune's first round beside the baselines and their fp16 twins, and
seed every search. Torch-free.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal, Mapping

from hybridsync.description import FLOATING_DTYPES, VariableInfo
from hybridsync.strategy import Strategy, VarConfig
from hybridsync.strategy_space import SpaceBounds, is_embedding_like, variable_class

ClassRoute = Literal["ps", "ps-sharded", "ring", "hierarchical", "gather", "rows-ps", "rows-gather"]
SPARSE_ALLGATHER = VarConfig(route="allreduce")
"""A sparse gradient all-reduced without being made dense: Horovod's all-gather, a message of its own."""
SHARD_BYTES = 1024 * 1024
"""Shard size of the ``ps-sharded`` class route (the sampler's middle partition size)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassPlan:
    """How every variable of one class is synchronized."""

    route: ClassRoute
    """``ps`` (whole, servers balanced by bytes), ``ps-sharded`` (shards of ``SHARD_BYTES``),
    ``ring`` / ``hierarchical`` all-reduce, ``gather`` (Horovod's sparse all-gather). The ``rows``
    class: ``ps`` or ``gather`` send its nonzero rows (``VarConfig.rows``)."""
    fp16: bool = False
    """fp16 compression on the class's floating-point gradients (never on sparse ones)."""
    fused: bool = False
    """The class's variables merged into one message (all-reduce routes)."""
    largest_alone: bool = False
    """With ``fused``: the class's largest variable stays in a message of its own."""
    stages: int = 1
    """With ``fused``: that many merged messages of about equal bytes in backward order (last
    layer first), as PyTorch DDP's gradient buckets: the first goes out while the backward pass
    still computes the rest, instead of one message waiting for the last gradient."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Seed:
    """A named hand-made strategy: ``plans`` per class (``sparse``, ``large``, ``small``, and ``rows``:
    embedding-like dense variables, which recipes without it treat as their dense class)."""

    name: str
    plans: Mapping[str, ClassPlan]
    why: str
    rows: frozenset[str] = frozenset()
    """The model's variables of the ``rows`` class (``embedding_like``), once the seed meets a model."""


def _dense(route: ClassRoute, **plan: bool) -> dict[str, ClassPlan]:
    """Both dense classes on ``route`` as one fused class (``large`` and ``small`` share the group)."""
    return {"large": ClassPlan(route=route, **plan), "small": ClassPlan(route=route, **plan)}


def seed_recipes(hierarchical: bool) -> list[Seed]:
    """The recipes, before they meet a model (a recipe whose classes are empty collapses onto another)."""
    best = "hierarchical" if hierarchical else "ring"
    ps = ClassPlan(route="ps")
    merged = dict(fused=True, largest_alone=True)
    return [
        Seed(name="sparse-ps-dense-merged", plans={"sparse": ps, **_dense(best, **merged)},
             why="embeddings whole on the PS; dense layers in one merged message, the largest alone"),
        Seed(name="sparse-ps-dense-merged-fp16", plans={"sparse": ps, **_dense(best, fp16=True, **merged)},
             why="the same with fp16 on the dense gradients"),
        Seed(name="sparse-ps-dense-ring-fused-fp16", plans={"sparse": ps, **_dense("ring", fp16=True, fused=True)},
             why="embeddings on the PS; dense ring all-reduce fused, fp16"),
        Seed(name="sparse-gather-dense-merged-fp16",
             plans={"sparse": ClassPlan(route="gather"), **_dense(best, fp16=True, **merged)},
             why="embeddings by Horovod's sparse all-gather instead of the PS"),
        Seed(name="sparse-sharded-dense-merged-fp16",
             plans={"sparse": ClassPlan(route="ps-sharded"), **_dense(best, fp16=True, **merged)},
             why="embeddings sharded over every server instead of whole"),
        Seed(name="sparse-ps-dense-two-stage", plans={"sparse": ps, **_dense(best, fused=True, stages=2)},
             why="embeddings on the PS; dense layers merged in two messages by backward order, the first "
                 "overlapping the rest of the backward pass"),
        Seed(name="sparse-ps-dense-two-stage-fp16",
             plans={"sparse": ps, **_dense(best, fp16=True, fused=True, stages=2)},
             why="the same with fp16 on the dense gradients"),
        Seed(name="sparse-ps-dense-four-stage-fp16",
             plans={"sparse": ps, **_dense(best, fp16=True, fused=True, stages=4)},
             why="the same in four messages: on models whose gradients are ready evenly through the backward "
                 "pass (CNNs, transformer blocks) each goes out while the next computes"),
        Seed(name="small-fused-large-alone-fp16",
             plans={"sparse": ps, "small": ClassPlan(route="ring", fp16=True, fused=True),
                    "large": ClassPlan(route=best, fp16=True)},
             why="per class: small dense fused on the ring, large dense on their own messages"),
        Seed(name="large-ps-sharded-small-fused",
             plans={"sparse": ps, "small": ClassPlan(route=best, fused=True),
                    "large": ClassPlan(route="ps-sharded")},
             why="per class: large dense sharded over the servers, small dense merged"),
        Seed(name="rows-ps-dense-merged", plans={"rows": ps, "sparse": ps, **_dense(best, **merged)},
             why="dense embeddings' nonzero rows on the PS; the other dense layers merged (lossless: exact mode's)"),
        Seed(name="rows-gather-dense-merged",
             plans={"rows": ClassPlan(route="gather"), "sparse": ps, **_dense(best, **merged)},
             why="dense embeddings' nonzero rows by Horovod's sparse all-gather; the other dense layers merged"),
        Seed(name="rows-ps-dense-merged-fp16",
             plans={"rows": ps, "sparse": ps, **_dense(best, fp16=True, **merged)},
             why="dense embeddings' nonzero rows on the PS; the other dense layers merged, fp16"),
        Seed(name="rows-gather-dense-merged-fp16",
             plans={"rows": ClassPlan(route="gather"), "sparse": ps, **_dense(best, fp16=True, **merged)},
             why="dense embeddings' nonzero rows by Horovod's sparse all-gather; the other dense layers merged, fp16"),
        Seed(name="rows-gather-dense-two-stage",
             plans={"rows": ClassPlan(route="gather"), "sparse": ps, **_dense(best, fused=True, stages=2)},
             why="dense embeddings' nonzero rows by the all-gather; the other dense layers in two messages by "
                 "backward order (lossless: exact mode's)"),
        Seed(name="rows-gather-dense-two-stage-fp16",
             plans={"rows": ClassPlan(route="gather"), "sparse": ps, **_dense(best, fp16=True, fused=True, stages=2)},
             why="the same with fp16 on the other dense gradients"),
        Seed(name="rows-gather-dense-four-stage-fp16",
             plans={"rows": ClassPlan(route="gather"), "sparse": ps, **_dense(best, fp16=True, fused=True, stages=4)},
             why="the same in four messages by backward order"),
    ]


def structured_seeds(variables: Mapping[str, VariableInfo], bounds: SpaceBounds, *,
                     rows_touched: Mapping[str, int] | None = None) -> list[tuple[str, Strategy]]:
    """(name, strategy) of every recipe for ``variables`` within ``bounds``, validated; recipes
    that give the same strategy on this model (no sparse variable, no server...) appear once.
    ``rows_touched``: the profiled description's (``VariableTiming.rows_touched``), which says
    which dense variables are embedding-like (``embedding_like``)."""
    out: dict[str, tuple[str, Strategy]] = {}
    embeddings = embedding_like(variables, rows_touched or {})
    for seed in seed_recipes(bounds.hierarchical):
        if bounds.exact and any(plan.fp16 for plan in seed.plans.values()):
            continue
        strategy = build_seed(seed, variables, bounds, rows=embeddings)
        out.setdefault(strategy.fingerprint(), (seed.name, strategy))
    return list(out.values())


def recipe_label(name: str, variables: Mapping[str, VariableInfo]) -> str:
    """Recipe ``name`` as trials and reports show it for ``variables``: without its ``sparse-<route>-``
    part on a model that has no sparse variable, where that part does nothing (a vision
    transformer's two-stage fp16 mix is ``dense-two-stage-fp16``, not ``sparse-ps-dense-...``)."""
    if name.startswith("sparse-") and not any(info.sparse for info in variables.values()):
        return name.split("-", 2)[2]
    return name


def embedding_like(variables: Mapping[str, VariableInfo], rows_touched: Mapping[str, int]) -> frozenset[str]:
    """The ``rows`` class: the variables ``strategy_space.is_embedding_like`` (large dense floating,
    profiled steps touching at most ``strategy_space.ROWS_SHARE`` of their rows)."""
    return frozenset(name for name, info in variables.items() if is_embedding_like(info, rows_touched.get(name)))


def build_seed(seed: Seed, variables: Mapping[str, VariableInfo], bounds: SpaceBounds, *,
               rows: frozenset[str] = frozenset()) -> Strategy:
    """``seed``'s strategy for ``variables``: each class's plan, fused classes in one merge group
    per (route, compression) and stage (``ClassPlan.stages``), a fused class's largest variable
    alone when asked; ``rows``: the embedding-like variables (``embedding_like``), on the seed's
    ``rows`` plan if it has one."""
    seed = dataclasses.replace(seed, rows=rows if "rows" in seed.plans else frozenset())
    configs = {name: _config(_plan(seed, info, bounds), info, bounds) for name, info in variables.items()}
    alone = _largest_alone(seed, variables, bounds)
    merged = [name for name, info in variables.items() if _plan(seed, info, bounds).fused and name not in alone
              and not (info.sparse and configs[name] == SPARSE_ALLGATHER)]
    stage = _stages(seed, merged, configs, variables, bounds)
    groups: dict[tuple, int] = {}
    for name in merged:
        group = groups.setdefault((configs[name].message_key, stage[name]), len(groups))
        configs[name] = dataclasses.replace(configs[name], group=group)
    strategy = Strategy(variables=_without_lone_groups(configs))
    strategy.validate_for(variables)
    return strategy


def _plan(seed: Seed, info: VariableInfo, bounds: SpaceBounds) -> ClassPlan:
    as_rows = info.name in seed.rows
    plan = seed.plans["rows" if as_rows else variable_class(info)]
    if as_rows:  # sent as rows: on the PS, or (no servers, or asked) Horovod's sparse all-gather
        return dataclasses.replace(plan, route="rows-ps" if plan.route == "ps" and bounds.num_servers else "rows-gather")
    route = plan.route
    if route == "hierarchical" and not bounds.hierarchical:
        route = "ring"
    if route.startswith("ps") and bounds.num_servers == 0:
        route = "gather" if info.sparse else "ring"
    return dataclasses.replace(plan, route=route, fp16=plan.fp16 and not bounds.exact)


def _config(plan: ClassPlan, info: VariableInfo, bounds: SpaceBounds) -> VarConfig:
    if plan.route.startswith("rows-"):
        return VarConfig(route="ps", rows=True) if plan.route == "rows-ps" else VarConfig(route="allreduce", rows=True)
    compression = "fp16" if plan.fp16 and not info.sparse and info.dtype in FLOATING_DTYPES else None
    if plan.route == "gather" or (info.sparse and plan.route in ("ring", "hierarchical")
                                  and not bounds.densify_sparse):
        return SPARSE_ALLGATHER
    if plan.route.startswith("ps"):
        rows = info.shape[0] if info.shape else 1
        shards = min(rows, bounds.max_partitions, math.ceil(info.nbytes / SHARD_BYTES))
        partitions = max(1, shards) if plan.route == "ps-sharded" else 1
        return VarConfig(route="ps", partitions=partitions, compression=compression)
    return VarConfig(route="allreduce", algorithm=plan.route, compression=compression)


def _stages(seed: Seed, merged: list[str], configs: Mapping[str, VarConfig], variables: Mapping[str, VariableInfo],
            bounds: SpaceBounds) -> dict[str, int]:
    """Stage (0: ready first) of each merged variable: its message's members split by their bytes in
    backward order (last variable first, as ``baselines.horovod_hierarchical``) into its plan's
    ``stages`` parts of about equal bytes."""
    members: dict[tuple, list[str]] = {}
    for name in reversed(merged):
        members.setdefault(configs[name].message_key, []).append(name)
    out: dict[str, int] = {}
    for names in members.values():
        stages = _plan(seed, variables[names[0]], bounds).stages
        total, before = sum(variables[n].nbytes for n in names) or 1, 0
        for name in names:
            out[name] = min(stages - 1, before * stages // total)
            before += variables[name].nbytes
    return out


def _largest_alone(seed: Seed, variables: Mapping[str, VariableInfo], bounds: SpaceBounds) -> set[str]:
    """The largest variable of each fused group that asks for it (classes sharing a plan share one)."""
    sizes: dict[tuple, tuple[int, str]] = {}
    for name, info in variables.items():
        plan = _plan(seed, info, bounds)
        if plan.fused and plan.largest_alone:
            key = _config(plan, info, bounds).message_key
            sizes[key] = max(sizes.get(key, (-1, "")), (info.nbytes, name))
    return {name for _, name in sizes.values()}


def _without_lone_groups(configs: dict[str, VarConfig]) -> dict[str, VarConfig]:
    """Groups of one member dissolved (a merge group of one is only a name), the rest numbered 0, 1, ..."""
    members: dict[int, list[str]] = {}
    for name, config in configs.items():
        if config.group is not None:
            members.setdefault(config.group, []).append(name)
    shared = [g for g, names in members.items() if len(names) > 1]
    number = {g: i for i, g in enumerate(shared)}
    return {name: dataclasses.replace(config, group=number.get(config.group)) if config.group is not None else config
            for name, config in configs.items()}
