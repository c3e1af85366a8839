"""Run under horovodrun/mpirun: provoke each user mistake and record what every rank raised.

Usage: python errors.py OUT_PREFIX   -> writes OUT_PREFIX.rank<R>.json
Each case records the exception type and message (or "no error") and how long it took,
so the test can check that every rank failed, clearly and within seconds.
"""
from __future__ import annotations

import collections
import gc
import json
import os
import sys
import tempfile
import time
import weakref

import horovod.torch as hvd
import torch
import torch.nn as nn

import hybridsync as hs


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def make(strategy=None, named=None, **kwargs):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return m, hs.DistributedOptimizer(opt, named_parameters=named if named is not None else m.named_parameters(),
                                      strategy=strategy, **kwargs)


def backward(m: nn.Module) -> None:
    m(torch.randn(3, 4)).sum().backward()


def step_with(strategy) -> None:
    """A strategy names the whole model's variables (a script may split them among optimizers): one
    that no optimizer holds is refused at the first step, once the script built every optimizer."""
    m, opt = make(strategy)
    backward(m)
    opt.step()


def strategy_for_the_unwrapped_model() -> None:
    """A strategy made for the bare model, used with the model wrapped (``DataParallel`` prefixes every
    name with ``module.``): each name is refused with the wrapped name it means."""
    m = nn.DataParallel(nn.Sequential(collections.OrderedDict(encoder=nn.Linear(4, 2))))  # names no other case has
    opt = hs.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                  strategy={"variables": {"encoder.weight": {"route": "allreduce", "partitions": 2}}})
    backward(m)
    opt.step()


def two_optimizers_share_a_strategy():
    """One strategy for a model split between two optimizers (as a sparse and a dense one are): each
    routes its own variables as the strategy says, neither refuses the other's."""
    m = model()
    strategy = {"variables": {"0.weight": {"route": "allreduce", "partitions": 2},
                              "2.weight": {"route": "allreduce", "compression": "fp16"}}}
    first, second = ([(n, p) for n, p in m.named_parameters() if n.startswith("0.")],
                     [(n, p) for n, p in m.named_parameters() if n.startswith("2.")])
    opts = [hs.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.1), named_parameters=named,
                                    strategy=strategy) for named in (first, second)]
    backward(m)
    for opt in opts:
        opt.step()
    routed = [sorted(opt.strategy.variables) for opt in opts]
    if routed != [["0.weight"], ["2.weight"]]:
        raise AssertionError(f"each optimizer should route its own part, got {routed}")


def strategy_names_a_group_added_later():
    """Fine-tuning: the head joins the optimizer after a step (``add_param_group``), and the strategy
    configures it. The first step refused the strategy ("not in the model"); now the head is routed as
    the strategy says once it is added."""
    torch.manual_seed(0)  # names no other case uses: the cases share one process, and what it holds
    m = nn.ModuleDict({"backbone": nn.Linear(4, 8), "late_head": nn.Linear(8, 2)})
    opt = hs.DistributedOptimizer(torch.optim.SGD(m["backbone"].parameters(), lr=0.1),
                                  named_parameters=m.named_parameters(),
                                  strategy={"variables": {"late_head.weight": {"route": "allreduce", "partitions": 2}}})
    for step in range(3):
        if step == 1:
            opt.add_param_group({"params": list(m["late_head"].parameters())})
        opt.zero_grad()
        m["late_head"](m["backbone"](torch.randn(3, 4))).sum().backward()
        opt.step()
    sent = {piece.var_name: message.config.partitions for message in opt.plan.messages for piece in message.pieces}
    if sent.get("late_head.weight") != 2:
        raise AssertionError(f"the head should go in 2 partitions once added, got {sent}")


def strategy_names_an_earlier_models_variable():
    """A process that trained another model first (a notebook, a sweep, these cases): a strategy naming
    a variable only that model had is refused, once its optimizer is gone. Every optimizer built so
    far lent its names to every later check, so the misspelt name passed in silence; and a dropped
    model lived on with its optimizer (each held by the other's gradient hooks) to the end of the process."""
    earlier = nn.ModuleDict({"earlier_only": nn.Linear(4, 2)})
    opt = hs.DistributedOptimizer(torch.optim.SGD(earlier.parameters(), lr=0.1),
                                  named_parameters=earlier.named_parameters())
    earlier["earlier_only"](torch.randn(3, 4)).sum().backward()
    opt.step()
    gone = weakref.ref(earlier["earlier_only"].weight)
    del earlier, opt
    gc.collect()
    if gone() is not None:  # its gradient hook held the optimizer, which held the model: kept for good
        raise AssertionError("the earlier model outlived its optimizer and every reference of the script")
    step_with({"variables": {"earlier_only.weight": {"route": "allreduce", "partitions": 2}}})


class FourierLayer(nn.Module):
    """A layer with a complex weight (as FFT layers have), then a real read-out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.spectral = nn.Parameter(torch.randn(6, 4, dtype=torch.complex64))
        self.readout = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout((torch.fft.fft(x.to(torch.complex64)) @ self.spectral).abs()).sum()


def train_fourier(strategy=None, frozen: bool = False) -> None:
    m = FourierLayer()
    m.spectral.requires_grad_(not frozen)
    opt = hs.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                                  strategy=strategy)
    for _ in range(2):
        opt.zero_grad()
        m(torch.randn(5, 6)).backward()
        opt.step()


def complex_on_the_ring():
    """Horovod's ring refuses complex tensors from inside the backward pass, naming no variable (as
    Horovod's own optimizer does): refused when the optimizer is built, naming the variable."""
    train_fourier()


def complex_routed_hierarchical_or_frozen():
    """The routes that sum complex gradients carry them; a frozen complex parameter sends nothing."""
    train_fourier({"variables": {"spectral": {"route": "allreduce", "algorithm": "hierarchical"}}})
    train_fourier(frozen=True)


def rank_dependent_strategy():
    if hvd.rank() == 0:
        return make({"variables": {"0.weight": {"route": "allreduce", "partitions": 2}}})
    return make(None)


def zero_grad_before_step():
    m, opt = make()
    backward(m)
    try:
        opt.zero_grad()
    finally:
        opt.synchronize()  # keep the ranks' collectives matched after the expected error


def too_many_backward_passes():
    m, opt = make()
    backward(m)
    try:
        backward(m)
    finally:
        opt.synchronize()


def strategy_from_environment():
    path = os.path.join(tempfile.mkdtemp(), "s.json")
    with open(path, "w") as f:
        json.dump({"version": 1, "variables": {"nope.weight": {"route": "allreduce"}}}, f)
    os.environ["HYBRIDSYNC_STRATEGY"] = path
    try:
        step_with(None)
    finally:
        del os.environ["HYBRIDSYNC_STRATEGY"]


def ps_worker_count_mismatch():
    """PS settings that name 3 workers in a 2-rank job: refused before anyone tries to join."""
    settings = {"DMLC_NUM_WORKER": "3", "DMLC_NUM_SERVER": "1", "DMLC_PS_ROOT_URI": "127.0.0.1",
                "DMLC_PS_ROOT_PORT": "9"}
    os.environ.update(settings)
    try:
        make({"default": {"route": "ps"}})
    finally:
        for var in settings:
            del os.environ[var]


def frozen_on_one_rank():
    m = model()
    if hvd.rank() == 1:
        m[0].bias.requires_grad_(False)
    hs.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())


def sparse_on_one_rank():
    """Rank 0's embedding is sparse, rank 1's dense: same strategy and plan, clash at the first step."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(10, 4, sparse=hvd.rank() == 0), nn.Linear(4, 2))
    opt = hs.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    m(torch.tensor([[1, 2], [3, 4]])).sum().backward()
    opt.step()


def strategy_names_a_tied_alias() -> None:
    """A tied weight listed under both its names is one variable, under the first: a strategy that
    configures it under the second is told which name to use."""
    embed = nn.Embedding(6, 4)
    decoder = nn.Linear(4, 6, bias=False)
    decoder.weight = embed.weight
    m = nn.ModuleDict({"embed": embed, "decoder": decoder})
    opt = hs.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                  named_parameters=m.named_parameters(remove_duplicate=False),
                                  strategy={"variables": {"decoder.weight": {"route": "allreduce", "partitions": 2}}})
    m["decoder"](m["embed"](torch.tensor([1, 2]))).sum().backward()
    opt.step()


def wrapped_twice() -> None:
    """A script half migrated: Horovod's optimizer (or hybridsync's) wrapped again."""
    m = model()
    inner = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters())
    hs.DistributedOptimizer(inner, named_parameters=m.named_parameters())


def model_differs_on_one_rank():
    """Rank 1's first layer takes 6 inputs, rank 0's 4: the same parameter names and rows, other sizes.
    Before, the ranks agreed (the plan hashed rows only), and the hierarchical route summed the
    different gradients silently."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4 + 2 * hvd.rank(), 8), nn.ReLU(), nn.Linear(8, 2))
    hs.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), named_parameters=m.named_parameters(),
                            strategy={"default": {"route": "allreduce", "algorithm": "hierarchical"}})


CASES = {
    "fingerprint_mismatch": rank_dependent_strategy,
    "two_optimizers_share_a_strategy": two_optimizers_share_a_strategy,
    "strategy_names_an_earlier_models_variable": strategy_names_an_earlier_models_variable,
    "unknown_variable": lambda: step_with({"variables": {"missing.weight": {"route": "allreduce"}}}),
    "strategy_for_the_unwrapped_model": strategy_for_the_unwrapped_model,
    "bad_value": lambda: make({"variables": {"0.weight": {"route": "allreduce", "partitions": 0,
                                                          "compression": "int3"}}}),
    "too_many_partitions": lambda: make({"variables": {"2.bias": {"route": "allreduce", "partitions": 5}}}),
    "missing_file": lambda: make("/nonexistent/strategy.json"),
    "strategy_from_environment": strategy_from_environment,
    "ps_without_servers": lambda: make({"variables": {"0.weight": {"route": "ps"}}}),
    "ps_worker_count_mismatch": ps_worker_count_mismatch,
    # Not an error any more: hierarchical groups need no hs.init() (they are built when a plan uses them).
    "hierarchical_after_plain_hvd_init": lambda: make({"variables": {"0.weight": {"route": "allreduce",
                                                                             "algorithm": "hierarchical"}}}),
    "duplicate_names": lambda: make(named=[("w", p) for p in model().parameters()]),
    "wrapped_twice": lambda: wrapped_twice(),
    "strategy_names_a_tied_alias": strategy_names_a_tied_alias,
    "strategy_names_a_group_added_later": strategy_names_a_group_added_later,
    "predivide_with_sum": lambda: make(op=hs.Sum, gradient_predivide_factor=2.0),
    "compression_by_name": lambda: make(compression="fp16"),
    "zero_grad_before_step": zero_grad_before_step,
    "frozen_on_one_rank": frozen_on_one_rank,
    "backward_passes_differ": lambda: make(backward_passes_per_step=1 + hvd.rank()),
    "sparse_on_one_rank": sparse_on_one_rank,
    "model_differs_on_one_rank": model_differs_on_one_rank,
    "too_many_backward_passes": too_many_backward_passes,
    "complex_on_the_ring": complex_on_the_ring,
    "complex_routed_hierarchical_or_frozen": complex_routed_hierarchical_or_frozen,
}


def main() -> None:
    hvd.init()
    make()  # first use pays imports and Horovod's first collectives; the cases time only the mistake
    hvd.barrier()
    results = {}
    for name, case in CASES.items():
        start = time.perf_counter()
        try:
            case()
            outcome = {"type": None, "message": "no error"}
        except Exception as e:  # the point is to record what users would see
            outcome = {"type": type(e).__name__, "message": str(e)}
        outcome["seconds"] = round(time.perf_counter() - start, 3)
        results[name] = outcome
        hvd.barrier()
    with open(f"{sys.argv[1]}.rank{hvd.rank()}.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
