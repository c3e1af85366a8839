"""Run under horovodrun/mpirun: train the same model with Horovod's optimizer and with
hybridsync's, case by case, and write each case's largest parameter difference to JSON.

Usage: python equivalence.py OUT.json [CASE ...]   (no case: all of CASES; PS_CASES need servers)
Every rank trains on its own data, so the result depends on a correct reduction.
"""
from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

import horovod.torch as hvd
import torch
import torch.nn as nn

import hybridsync as hs

STEPS = 4
GROUPED = {"fc1.weight": {"route": "allreduce", "group": 1}, "fc1.bias": {"route": "allreduce", "group": 1},
           "fc2.weight": {"route": "allreduce", "group": 2}, "fc2.bias": {"route": "allreduce", "group": 2}}
PARTITIONED = {"fc1.weight": {"route": "allreduce", "partitions": 3},
               "fc2.weight": {"route": "allreduce", "partitions": 2}, "emb.weight": {"route": "allreduce", "partitions": 4}}
MIXED = {"fc1.weight": {"route": "allreduce", "partitions": 2, "group": 1, "compression": "fp16"},
         "fc1.bias": {"route": "allreduce", "group": 1, "compression": "fp16"},
         "fc2.weight": {"route": "allreduce", "partitions": 2, "group": 7},
         "fc2.bias": {"route": "allreduce", "group": 7}, "emb.weight": {"route": "allreduce", "partitions": 2}}


HIERARCHICAL_MIXED = {
    "fc1.weight": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 2, "group": 1,
                   "compression": "fp16"},
    "fc1.bias": {"route": "allreduce", "algorithm": "hierarchical", "group": 1, "compression": "fp16"},
    "fc2.weight": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 3},
    "emb.weight": {"route": "allreduce", "algorithm": "ring", "partitions": 2}}


SPARSE_RING = {"emb.weight": {"route": "allreduce", "partitions": 2, "group": 1},
               "fc1.weight": {"route": "allreduce", "group": 1}}
SPARSE_HIERARCHICAL = {"emb.weight": {"route": "allreduce", "algorithm": "hierarchical"},
                       "fc1.weight": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 2},
                       "fc2.weight": {"route": "allreduce", "algorithm": "hierarchical"}}


def strategy(variables: dict) -> dict:
    return {"version": 1, "default": {"route": "allreduce", "algorithm": "ring"}, "variables": variables}


# name -> (optimizer kwargs for both, hybridsync-only kwargs, model kwargs, tolerance)
CASES = {
    "default": ({}, {}, {}, 1e-5),
    "op_sum": ({"op": "Sum"}, {}, {}, 1e-5),
    "backward_passes_2": ({"backward_passes_per_step": 2}, {}, {}, 1e-5),
    "fp16": ({"compression": "fp16"}, {}, {}, 2e-3),
    "predivide": ({"gradient_predivide_factor": 2.0}, {}, {}, 1e-5),
    "adam": ({"optim": "adam"}, {}, {}, 1e-5),
    "sparse_embedding": ({}, {}, {"sparse": True}, 1e-5),
    "merge_groups": ({}, {"strategy": strategy(GROUPED)}, {}, 1e-5),
    "partitions": ({}, {"strategy": strategy(PARTITIONED)}, {}, 1e-5),
    "per_variable_fp16": ({}, {"strategy": strategy({"fc1.weight": {"route": "allreduce", "compression": "fp16"}})},
                          {}, 2e-3),
    "mixed_groups_partitions_fp16": ({}, {"strategy": strategy(MIXED)}, {}, 2e-3),
    "unused_parameter": ({}, {"strategy": strategy(GROUPED)}, {"unused": True}, 1e-5),
    "hierarchical": ({}, {"strategy": {"default": {"route": "allreduce", "algorithm": "hierarchical"}}}, {}, 1e-5),
    "hierarchical_sum_predivide": ({"gradient_predivide_factor": 2.0},
                                   {"strategy": {"default": {"route": "allreduce", "algorithm": "hierarchical"}}},
                                   {}, 1e-5),
    "hierarchical_mixed_with_ring": ({}, {"strategy": strategy(HIERARCHICAL_MIXED)}, {}, 2e-3),
    # Sparse gradients where the all-reduce routes cannot send them sparse: made dense for the message.
    "sparse_ring_partitions_groups": ({}, {"strategy": strategy(SPARSE_RING)}, {"sparse": True}, 1e-5),
    "sparse_hierarchical": ({}, {"strategy": strategy(SPARSE_HIERARCHICAL)}, {"sparse": True}, 1e-5),
    "sparse_unused_first_step": ({}, {}, {"sparse": True, "emb_from_step": 1}, 1e-5),
    # Gradient clipping as Horovod documents it: synchronize(), clip, step() under skip_synchronize().
    "clip_hierarchical_mixed": ({"clip": 0.05}, {"strategy": strategy(HIERARCHICAL_MIXED)}, {}, 2e-3),
    "clip_groups_partitions": ({"clip": 0.05, "backward_passes_per_step": 2}, {"strategy": strategy(MIXED)}, {},
                               2e-3),
}


PS_MIXED = {"emb.weight": {"route": "ps", "partitions": 2, "servers": [1, 0]},
            "fc1.weight": {"route": "ps", "group": 3}, "fc1.bias": {"route": "ps", "group": 3}}
PS_FP16_PARTITIONS = {"fc1.weight": {"route": "ps", "partitions": 2, "compression": "fp16"},
                      "fc2.weight": {"route": "ps", "partitions": 3}}
PS_HIERARCHICAL_RING = {
    "emb.weight": {"route": "ps", "partitions": 2},
    "fc1.weight": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 2, "group": 1},
    "fc1.bias": {"route": "allreduce", "algorithm": "hierarchical", "group": 1},
    "fc2.weight": {"route": "ps", "group": 2}, "fc2.bias": {"route": "ps", "group": 2}}

PS_SPARSE_GROUPED = {"emb.weight": {"route": "ps", "partitions": 2, "group": 4},
                     "fc1.weight": {"route": "ps", "group": 4}, "fc1.bias": {"route": "ps", "group": 4}}


def baseline(name: str) -> dict:
    """A baseline strategy built, as a user would, from the sparse model's description."""
    from hybridsync import baselines
    from hybridsync.variables import variables_from_model
    variables = variables_from_model(Net(sparse=True))
    if name == "parallax":
        return baselines.parallax(variables, num_servers=2).to_dict()
    return baselines.partitioned_ps(variables, num_servers=2, partition_bytes=400).to_dict()


# Cases that need parameter servers (run under hybridsync-run --num-servers K, never by default).
# Every case builds new optimizers over the same parameter names in one job: each optimizer's
# keys live in its own namespace on the servers (ps_all routes 'emb.weight' dense, the sparse
# cases after it route the same name sparse).
PS_CASES = {
    "ps_all": ({}, {"strategy": {"default": {"route": "ps"}}}, {}, 1e-5),
    "ps_mixed_with_ring": ({}, {"strategy": strategy(PS_MIXED)}, {}, 1e-5),
    "ps_sparse_embedding": ({}, {"strategy": strategy({"emb.weight": {"route": "ps"}})}, {"sparse": True}, 1e-5),
    "ps_sum_fp16_partitions": ({"op": "Sum"}, {"strategy": strategy(PS_FP16_PARTITIONS)}, {}, 2e-3),
    "ps_predivide_backward_passes_2": ({"gradient_predivide_factor": 2.0, "backward_passes_per_step": 2},
                                       {"strategy": {"default": {"route": "ps"}}}, {}, 1e-5),
    "ps_hierarchical_ring_mixed": ({}, {"strategy": strategy(PS_HIERARCHICAL_RING)}, {}, 1e-5),
    "ps_clip_mixed_with_ring": ({"clip": 0.05}, {"strategy": strategy(PS_MIXED)}, {}, 1e-5),
    "ps_sparse_partitions": ({}, {"strategy": strategy({"emb.weight": {"route": "ps", "partitions": 2}})},
                             {"sparse": True}, 1e-5),
    "ps_sparse_partitions_grouped": ({}, {"strategy": strategy(PS_SPARSE_GROUPED)}, {"sparse": True}, 1e-5),
    # no rank looks the sparse embedding up in the first step: its keys must not be fixed dense then
    "ps_sparse_unused_first_step": ({}, {"strategy": strategy({"emb.weight": {"route": "ps"},
                                                               "fc1.weight": {"route": "ps", "partitions": 2}})},
                                    {"sparse": True, "emb_from_step": 1}, 1e-5),
    "ps_parallax_baseline": ({}, {"strategy": "parallax"}, {"sparse": True}, 1e-5),
    "ps_partitioned_baseline": ({}, {"strategy": "partitioned_ps"}, {"sparse": True}, 1e-5),
    # ASP steps locally (the sparse gradient stays local) and pushes dense parameter deltas:
    # not Horovod's BSP result, so only a loose bound; it must run and move the parameters.
    "ps_asp_sparse_partitions": ({}, {"strategy": strategy({"emb.weight": {"route": "ps", "partitions": 2,
                                                                          "protocol": "asp"}})},
                                 {"sparse": True}, 0.5),
    # An all-PS optimizer over a dense model, then a second optimizer in the same job once the
    # embedding became sparse, with emb.weight sparse on the PS (the same names, new keys).
    "ps_second_optimizer_sparse": ({}, {"strategy": {"default": {"route": "ps"}},
                                        "second_strategy": strategy({"emb.weight": {"route": "ps",
                                                                                   "partitions": 2}})},
                                   {"second_sparse": True}, 1e-5),
}

# A dense embedding's gradient (nn.Embedding(sparse=False)) sent as its nonzero rows (``rows``): on the
# ring as Horovod's sparse all-gather, on the servers as touched-row keys (whole, shards, merge group).
ROWS_RING = {"emb.weight": {"route": "allreduce", "rows": True}, "fc1.weight": {"route": "allreduce", "rows": True}}
ROWS_RING_HIERARCHICAL = {"emb.weight": {"route": "allreduce", "rows": True},
                          "fc1.weight": {"route": "allreduce", "algorithm": "hierarchical", "partitions": 2},
                          "fc2.weight": {"route": "allreduce", "algorithm": "hierarchical", "group": 1},
                          "fc2.bias": {"route": "allreduce", "algorithm": "hierarchical", "group": 1}}
ROWS_PS = {"emb.weight": {"route": "ps", "rows": True}, "fc2.weight": {"route": "ps", "rows": True, "partitions": 2}}
ROWS_PS_GROUPED = {"emb.weight": {"route": "ps", "partitions": 2, "group": 4, "rows": True},
                   "fc1.weight": {"route": "ps", "group": 4}, "fc1.bias": {"route": "ps", "group": 4}}
# Cases that need parameter servers for their PS part (tests/test_rows_route.py).
ROWS_CASES = {
    "rows_ring": ({}, {"strategy": strategy(ROWS_RING)}, {}, 1e-5),
    "rows_ring_adam_predivide": ({"optim": "adam", "gradient_predivide_factor": 2.0},
                                 {"strategy": strategy(ROWS_RING)}, {}, 1e-5),
    "rows_ring_with_hierarchical": ({}, {"strategy": strategy(ROWS_RING_HIERARCHICAL)}, {}, 1e-5),
    "rows_ring_sum": ({"op": "Sum"}, {"strategy": strategy(ROWS_RING)}, {}, 1e-5),
    # rank 1 has no embedding gradient: it sends no rows (the all-gather and the PS key take none)
    "rows_ring_one_rank_without_rows": ({}, {"strategy": strategy(ROWS_RING)}, {"emb_on_rank0_only": True}, 1e-5),
    "rows_ps_one_rank_without_rows": ({}, {"strategy": strategy(ROWS_PS)}, {"emb_on_rank0_only": True}, 1e-5),
    "rows_ps": ({}, {"strategy": strategy(ROWS_PS)}, {}, 1e-5),
    # the optimizer's fp16 applies to the other variables; the rows travel uncompressed
    "rows_ps_optimizer_fp16": ({"compression": "fp16"}, {"strategy": strategy(ROWS_PS)}, {}, 2e-3),
    "rows_ps_sum_grouped": ({"op": "Sum"}, {"strategy": strategy(ROWS_PS_GROUPED)}, {}, 1e-5),
}


class Net(nn.Module):
    def __init__(self, sparse: bool = False, unused: bool = False, emb_on_rank0_only: bool = False,
                 emb_from_step: int = 0) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=sparse)
        self.emb_on_rank0_only = emb_on_rank0_only
        """The other ranks never look the embedding up: no gradient there (no rows to send)."""
        self.emb_from_step = emb_from_step
        """No rank looks the embedding up in the forward passes before this one (a warm-up)."""
        self.forward_passes = 0
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4) if unused else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.forward_passes += 1
        looked_up = (self.emb(ids) if (not self.emb_on_rank0_only or hvd.rank() == 0)
                     and self.forward_passes > self.emb_from_step else torch.ones(*ids.shape, 8))
        out = self.fc2(torch.relu(self.fc1(looked_up.mean(dim=1))))
        if self.unused is not None and hvd.rank() == 0:
            out = out + 0.0 * self.unused(out)  # only rank 0 gets a gradient for 'unused'
        return out


def train(make_optimizer, model_kwargs: dict, common: dict, extra: dict) -> list[torch.Tensor]:
    model_kwargs, extra = dict(model_kwargs), dict(extra)
    second_sparse = model_kwargs.pop("second_sparse", False)
    second_strategy = extra.pop("second_strategy", None)
    if isinstance(extra.get("strategy"), str):
        extra["strategy"] = baseline(extra["strategy"])
    torch.manual_seed(0)
    model = Net(**model_kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    first = steps(model, make_optimizer, common, extra, gen)
    if second_sparse:  # a new phase: the embedding's gradient is sparse now, a new optimizer
        model.emb.sparse = True
        router = getattr(first, "_router", None)
        del first
        gc.collect()  # Horovod's optimizer: its hooks go only with the old optimizer (hybridsync's: replaced)
        steps(model, make_optimizer, common, {"strategy": second_strategy} if second_strategy else {}, gen)
        if router is not None:  # the first optimizer's hooks must not have fired in the second phase
            STALE_ROUTERS.append(router.pending)
    return [p.detach().clone() for p in model.parameters()]


STALE_ROUTERS: list[bool] = []
"""Per two-phase run: whether the first optimizer's router got gradients during the second phase."""


def steps(model: nn.Module, make_optimizer, common: dict, extra: dict, gen: torch.Generator) -> Any:
    """``STEPS`` training steps of ``model`` with a new (distributed) optimizer; returns the optimizer."""
    base = (torch.optim.Adam(model.parameters(), lr=0.01) if common.get("optim") == "adam"
            else torch.optim.SGD(model.parameters(), lr=0.1))
    kwargs = {k: v for k, v in common.items() if k not in ("optim", "clip")}
    opt = make_optimizer(base, named_parameters=list(model.named_parameters()), **kwargs, **extra)
    passes, clip = common.get("backward_passes_per_step", 1), common.get("clip")
    for _ in range(STEPS):
        opt.zero_grad()
        for _ in range(passes):
            ids = torch.randint(0, 50, (6, 5), generator=gen)
            target = torch.randn(6, 4, generator=gen)
            nn.functional.mse_loss(model(ids), target).backward()
        if clip is None:
            opt.step()
            continue
        opt.synchronize()  # the averaged gradients, clipped before the step (Horovod's documented recipe)
        nn.utils.clip_grad_norm_(model.parameters(), clip)
        with opt.skip_synchronize():
            opt.step()
    return opt


def resolve(common: dict, lib) -> dict:
    out = dict(common)
    if "op" in out:
        out["op"] = getattr(lib, out["op"])
    if "compression" in out:
        out["compression"] = getattr(lib.Compression, out["compression"])
    return out


def run_case(name: str) -> dict:
    common, extra, model_kwargs, tolerance = {**CASES, **PS_CASES, **ROWS_CASES}[name]
    start = time.perf_counter()
    expected = train(hvd.DistributedOptimizer, model_kwargs, resolve(common, hvd), {})
    pushed_before = ps_pushed_bytes()
    actual = train(hs.DistributedOptimizer, model_kwargs, resolve(common, hs), extra)
    diff = max(float((a - e).abs().max()) for a, e in zip(actual, expected))
    moved = max(float((a - b).abs().max()) for a, b in zip(actual, train_nothing(model_kwargs)))
    return {"max_abs_diff": diff, "tolerance": tolerance, "moved": moved,
            "stale_router_fired": any(STALE_ROUTERS),
            "ps_pushed_bytes": ps_pushed_bytes() - pushed_before, "seconds": round(time.perf_counter() - start, 2)}


def ps_pushed_bytes() -> int:
    """Bytes this rank pushed to parameter servers so far (0 when it never joined them)."""
    from hybridsync.backends.ps import client
    return client.get_client().counters.pushed_bytes if client.initialized() else 0


def train_nothing(model_kwargs: dict) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net(**{k: v for k, v in model_kwargs.items() if k != "second_sparse"})
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    hs.init()
    out_path, names = sys.argv[1], sys.argv[2:] or list(CASES)
    results = {name: run_case(name) for name in names}
    results["_world"] = {"size": hvd.size(), "local_size": hvd.local_size(), "cross_size": hvd.cross_size()}
    if hvd.local_size() > 1 and hvd.cross_size() > 1:  # which intra-node transport hierarchical cases used
        from hybridsync.backends.hierarchical import HierarchicalAllreduce
        results["_world"]["intra_node"] = HierarchicalAllreduce().intra_node
    if hvd.rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
