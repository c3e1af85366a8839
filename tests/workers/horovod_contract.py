"""Run under horovodrun/mpirun (2 ranks): what Horovod v0.28.1's optimizer tests check
(test/parallel/test_torch.py), checked here against hybridsync's optimizer.

Usage: python horovod_contract.py OUT_PREFIX [CASE ...]  -> OUT_PREFIX.rank<R>.json, {case: "ok" | error}
Each case is bounded: a hang dumps every thread's stack and exits, so the job fails
(naming the case) instead of stalling. Where it makes sense a case trains the same model
with ``horovod.torch.DistributedOptimizer`` and compares the parameters.
"""
from __future__ import annotations

import faulthandler
import inspect
import json
import os
import sys
import traceback
import warnings

# Horovod's own torch tests turn dynamic process sets on for the whole file; the process
# set case needs them (hvd.add_process_set).
os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import hybridsync as hs  # noqa: E402

CASE_TIMEOUT_S = 90
N, D_IN, H, D_OUT = 16, 20, 10, 5
OPTIMIZERS = sorted((torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adadelta,
                     torch.optim.Adagrad, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam,
                     torch.optim.RMSprop, torch.optim.Rprop), key=lambda c: c.__name__)
OPTIONS = (dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2))
BROADCASTS = {"hs": lambda opt, **kw: hs.broadcast_optimizer_state(opt, root_rank=0, **kw),
              "hvd": lambda opt, **kw: hvd.broadcast_optimizer_state(opt, root_rank=0, **kw)}


def check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def build(cls, options: dict, model: nn.Module) -> torch.optim.Optimizer:
    """``cls`` with the options it accepts (as Horovod's tests filter them)."""
    accepted = inspect.signature(cls.__init__).parameters
    return cls(model.parameters(), **{k: v for k, v in options.items() if k in accepted})


def mlp(seed: int | None = None) -> nn.Module:
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, H), nn.ReLU(), nn.Linear(H, D_OUT))


def rank_data(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + hvd.rank())
    return torch.randn(N, D_IN, generator=g), torch.randn(N, D_OUT, generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int = 0) -> None:
    x, y = rank_data(step)
    opt.zero_grad()
    F.mse_loss(model(x), y, reduction="sum").backward()
    opt.step()


def same_on_all_ranks(tensor: torch.Tensor, what: str) -> None:
    root = hvd.broadcast(tensor.detach().clone(), root_rank=0, name=f"contract.{what}")
    check(torch.equal(root, tensor), f"{what} differs from rank 0's")


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def state_values(opt: torch.optim.Optimizer) -> list[tuple[str, object]]:
    state = opt.state_dict()["state"]
    return [(k, v.clone() if torch.is_tensor(v) else v) for pid in sorted(state) for k, v in sorted(state[pid].items())]


# --- test_broadcast_state: resume from a checkpoint restored on rank 0 only -----------------------------------

def broadcast_state(function: str, checkpoint: str) -> None:
    for cls in OPTIMIZERS:
        for options in OPTIONS:
            model = mlp()
            opt = hs.DistributedOptimizer(build(cls, options, model), named_parameters=model.named_parameters())
            train_step(model, opt)
            expected_params = [hvd.broadcast(p.detach().clone(), 0, name=f"contract.p{i}")
                               for i, p in enumerate(model.state_dict().values())]
            expected_state = hvd.broadcast_object(state_values(opt), root_rank=0)
            if hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint)
            model = mlp()
            opt = hs.DistributedOptimizer(build(cls, options, model), named_parameters=model.named_parameters())
            if hvd.rank() == 0:
                saved = torch.load(checkpoint)
                model.load_state_dict(saved["model"])
                opt.load_state_dict(saved["optimizer"])
            hs.broadcast_parameters(model.state_dict(), root_rank=0)
            for p, expected in zip(model.state_dict().values(), expected_params):
                check(torch.equal(p, expected), f"{cls.__name__}: parameters after broadcast_parameters")
            BROADCASTS[function](opt)
            got = state_values(opt)
            where = f"{cls.__name__} {options}"
            check(len(got) == len(expected_state), f"{where}: {len(got)} state entries, rank 0 has {len(expected_state)}")
            for (name, value), (name0, value0) in zip(got, expected_state):
                check(name == name0 and type(value) is type(value0), f"{where}: state {name} vs rank 0's {name0}")
                check(torch.equal(value, value0) if torch.is_tensor(value) else value == value0,
                      f"{where}: state {name} differs from rank 0's")
            train_step(model, opt, step=1)  # training goes on: every rank synchronizes again
            for name, p in model.named_parameters():
                same_on_all_ranks(p.grad, f"{where} {name}.grad")


def broadcast_state_with_scheduler(function: str) -> None:
    """Resume as a script with an LR scheduler does: the scheduler, built before the broadcast, wraps
    ``opt.step`` (to count its calls), so Horovod's state-creating ``step()`` arrives through that
    wrapper. Only rank 0 restored a state: a synchronizing step on the others would hang them."""
    model = mlp(seed=1)
    opt = hs.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    if hvd.rank() == 0:  # a checkpoint of a plain run, restored on rank 0 only
        trained = mlp(seed=1)
        plain = torch.optim.Adam(trained.parameters(), lr=0.01)
        F.mse_loss(trained(rank_data()[0]), rank_data()[1]).backward()
        plain.step()
        opt.load_state_dict(plain.state_dict())
    BROADCASTS[function](opt)
    expected = hvd.broadcast_object(state_values(opt), root_rank=0)
    got = state_values(opt)
    check(len(got) == len(expected) > 0, f"{len(got)} state entries, rank 0 has {len(expected)}")
    for (name, value), (_, value0) in zip(got, expected):
        check(torch.equal(value, value0), f"state {name} differs from rank 0's")
    train_step(model, opt, step=1)
    scheduler.step()
    same_on_all_ranks(model[0].weight.detach(), "weight after a step")


# --- test_broadcast_state_options ---------------------------------------------------------------------------

RANK_OPTIONS = (dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999), etas=(0.8, 2.4),
                     step_sizes=(1e-5, 100)),
                dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9), etas=(0.25, 1.75),
                     step_sizes=(1e-7, 5)))


def broadcast_state_options(function: str) -> None:
    for cls in OPTIMIZERS:
        model = mlp()
        opt = hs.DistributedOptimizer(build(cls, RANK_OPTIONS[hvd.rank() % 2], model),
                                      named_parameters=model.named_parameters())
        train_step(model, opt)
        BROADCASTS[function](opt)
        accepted = inspect.signature(cls.__init__).parameters
        for key, value in RANK_OPTIONS[0].items():
            if key in accepted:
                got = opt.param_groups[0][key]
                check(type(got) is type(value) and got == value, f"{cls.__name__}.{key}: {got!r}, rank 0 has {value!r}")
        train_step(model, opt, step=1)  # the broadcast options still work in the update


# --- test_broadcast_state_no_grad ---------------------------------------------------------------------------

class IndexedScale(nn.Module):
    """An integer index parameter that requires no gradient next to a trainable one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = nn.Parameter(torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.b, 0, self.a.long()) * x


def broadcast_state_no_grad(function: str) -> None:
    model = IndexedScale()
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True)
    opt = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    BROADCASTS[function](opt)
    check(model.a.grad is None, "the frozen integer parameter was given a gradient")
    same_on_all_ranks(model.b.grad, "b.grad")
    index = model.a.detach().clone()
    opt.zero_grad()
    (model(torch.full((2,), float(hvd.rank() + 1))).sum()).backward()
    opt.step()
    check(model.a.grad is None and torch.equal(model.a, index), "the frozen parameter was touched by step()")
    same_on_all_ranks(model.b.grad, "b.grad after a step")
    same_on_all_ranks(model.b.detach(), "b after a step")


# --- test_force_allreduce: a parameter unused on one rank still gets the others' gradient --------------------

class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(D_IN, H), nn.Linear(H, D_OUT), nn.Linear(D_OUT, D_OUT)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h1 = self.fc2(F.relu(self.fc1(x)))
        return h1, self.fc3(F.relu(h1))


def force_allreduce() -> None:
    for cls in OPTIMIZERS:
        for options in OPTIONS:
            models = []
            for wrap in (hs.DistributedOptimizer, hvd.DistributedOptimizer):
                torch.manual_seed(0)
                model = TwoHeads()
                opt = wrap(build(cls, options, model), named_parameters=model.named_parameters())
                for step in range(2):
                    x, y = rank_data(step)
                    out1, out2 = model(x)
                    opt.zero_grad()
                    F.mse_loss(out1 if hvd.rank() == 0 else out2, y, reduction="sum").backward()
                    opt.step()
                models.append(model)
            diff = max_diff(*models)
            check(diff <= 1e-6, f"{cls.__name__} {options}: parameters differ from Horovod's by {diff}")
            for name, p in models[0].named_parameters():
                same_on_all_ranks(p.detach(), f"{cls.__name__} {name}")


# --- naming: test_duplicate_names, test_missing_named_parameters, test_no_named_parameters ------------------

def named_parameters_rules() -> None:
    net1, net2 = nn.Conv2d(1, 1, 1), nn.Conv2d(1, 1, 1)
    opt = torch.optim.SGD([*net1.parameters(), *net2.parameters()], lr=0.1)
    for named, text in (([*net1.named_parameters(), *net2.named_parameters()], "Found duplicates"),
                        (list(net1.named_parameters())[:1], "were not named")):
        try:
            hs.DistributedOptimizer(opt, named_parameters=named)
        except ValueError as e:
            check(text in str(e), f"unexpected message: {e}")
        else:
            raise AssertionError(f"no ValueError ({text})")
    models = []
    for wrap in (hs.DistributedOptimizer, hvd.DistributedOptimizer):
        model = mlp(seed=0)
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1))  # default names
        for step in range(2):
            train_step(model, opt, step)
        models.append(model)
    check(max_diff(*models) <= 1e-6, "without named_parameters the result differs from Horovod's")
    tied_parameter_named_twice()


class TiedLM(nn.Module):
    """A language model whose output layer shares the embedding's weight (one Parameter, two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(D_IN, H)
        self.out = nn.Linear(H, D_IN, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(ids).mean(dim=1)))


def tied_parameter_named_twice() -> None:
    """A tied Parameter listed under both its names (named_parameters(remove_duplicate=False), or the
    named parameters of two submodules concatenated): Horovod synchronizes it once, under one name."""
    for strategy in (None, {"version": 1, "default": {"algorithm": "hierarchical"},
                            "variables": {"emb.weight": {"partitions": 2}}}):
        models = []
        for wrap, extra in ((hs.DistributedOptimizer, {"strategy": strategy}), (hvd.DistributedOptimizer, {})):
            torch.manual_seed(0)
            model = TiedLM()
            opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                       named_parameters=model.named_parameters(remove_duplicate=False), **extra)
            for step in range(2):
                g = torch.Generator().manual_seed(1000 * step + hvd.rank())
                opt.zero_grad()
                F.cross_entropy(model(torch.randint(0, D_IN, (N, 3), generator=g)),
                                torch.randint(0, D_IN, (N,), generator=g)).backward()
                opt.step()
            models.append(model)
        diff = max_diff(*models)
        check(diff <= 1e-6, f"strategy {strategy}: a tied parameter named twice differs from Horovod's by {diff}")


# --- test_dynamic_requires_grad ------------------------------------------------------------------------------

def dynamic_requires_grad() -> None:
    gen, disc = nn.Conv2d(1, 10, 1), nn.Conv2d(10, 1, 1)
    inp = torch.rand(1, 1, 16, 16)
    gen_opt = hs.DistributedOptimizer(torch.optim.SGD(gen.parameters(), lr=0.1), named_parameters=gen.named_parameters())
    disc_opt = hs.DistributedOptimizer(torch.optim.SGD(disc.parameters(), lr=0.1),
                                       named_parameters=disc.named_parameters())
    for _ in range(3):
        for train_gen in (True, False):
            for p in gen.parameters():
                p.requires_grad_(train_gen)
            for p in disc.parameters():
                p.requires_grad_(not train_gen)
            gen_opt.zero_grad()
            disc_opt.zero_grad()
            disc(gen(inp)).sum().backward()
            for module, trained in ((gen, train_gen), (disc, not train_gen)):
                for p in module.parameters():
                    check((p.grad is not None and bool(p.grad.abs().max() > 0)) == trained,
                          "a gradient is zero although trained, or the reverse")
            (gen_opt if train_gen else disc_opt).step()


# --- test_gradient_clipping, test_synchronize_step_warning -------------------------------------------------

def gradient_clipping() -> None:
    model = nn.Linear(1, 1)
    model.weight = nn.Parameter(torch.zeros(1, 1) + 0.5)
    model.bias = nn.Parameter(torch.zeros(1))
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    opt.zero_grad()
    F.mse_loss(model(torch.ones(1, 1) * (hvd.rank() + 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    same_on_all_ranks(model.weight.grad, "weight.grad after synchronize()")
    before = model.weight.grad.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    check(abs(model.weight.grad.item()) < abs(before), "clipping did not shrink the synchronized gradient")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    check(not caught, f"skip_synchronize() step warned: {[str(w.message) for w in caught]}")


def synchronize_step_warning() -> None:
    model = nn.Linear(1, 1)
    hs.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    opt.zero_grad()
    F.mse_loss(model(torch.zeros(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    messages = [str(w.message) for w in caught]
    check(len(messages) == 1 and "optimizer.step() called without optimizer.skip_synchronize()" in messages[0],
          f"expected one skip_synchronize warning, got {messages}")


# --- test_sparse_embeddings (sparse_as_dense False and True) ---------------------------------------------------

def sparse_embeddings() -> None:
    indices = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if hvd.rank() == 0 else torch.tensor([[1, 3, 4], [4, 7, 9]])
    for sparse_as_dense in (False, True):
        models = []
        for wrap in (hs.DistributedOptimizer, hvd.DistributedOptimizer):
            torch.manual_seed(0)
            model = nn.Embedding(10, 3, sparse=True)
            opt = wrap(torch.optim.SparseAdam(list(model.parameters()), lr=0.1),
                       named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
            for _ in range(2):
                opt.zero_grad()
                model(indices).sum().backward()
                opt.synchronize()
                check(model.weight.grad.is_sparse, f"sparse_as_dense={sparse_as_dense}: step() gets a dense gradient")
                with opt.skip_synchronize():
                    opt.step()
            models.append(model)
        diff = max_diff(*models)
        check(diff <= 1e-6, f"sparse_as_dense={sparse_as_dense}: embeddings differ from Horovod's by {diff}")
        same_on_all_ranks(models[0].weight.detach(), f"embedding (sparse_as_dense={sparse_as_dense})")


# --- test_optimizer_process_sets ---------------------------------------------------------------------------

def optimizer_process_sets() -> None:
    even = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 0])
    odd = hvd.add_process_set([r for r in range(hvd.size()) if r % 2 == 1])
    try:
        mine = even if hvd.rank() % 2 == 0 else odd
        models = []
        for wrap in (hs.DistributedOptimizer, hvd.DistributedOptimizer):
            model = mlp(seed=0)
            opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                       process_set=mine)
            for step in range(2):
                train_step(model, opt, step)
            models.append(model)
        check(max_diff(*models) <= 1e-6, "within a process set the result differs from Horovod's")
        # A rank outside the process set neither hooks nor synchronizes: its gradients stay its own.
        model = mlp(seed=0)
        opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      named_parameters=model.named_parameters(), process_set=even)
        x, y = rank_data()
        opt.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        local = [p.grad.clone() for p in model.parameters()]
        opt.synchronize()
        check(all(torch.equal(a, p.grad) for a, p in zip(local, model.parameters())),
              "a one-rank process set changed its own rank's gradients, or synchronized a rank outside it")
        with opt.skip_synchronize():
            opt.step()
        try:
            hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                    named_parameters=model.named_parameters(), process_set=mine,
                                    strategy={"variables": {"0.weight": {"algorithm": "hierarchical"}}})
        except ValueError as e:
            check("process_set" in str(e) and "0.weight (allreduce/hierarchical)" in str(e), f"unclear error: {e}")
        else:
            raise AssertionError("a process set with a hierarchical strategy was accepted")
    finally:
        hvd.remove_process_set(odd)
        hvd.remove_process_set(even)


# --- groups / num_groups -------------------------------------------------------------------------------------

def groups_match_horovod() -> None:
    def model_groups(model: nn.Module) -> list:
        return [[model[0].weight, model[2].weight], [model[0].bias]]

    for kwargs, fused in ((dict(num_groups=2), [2, 2]), (dict(groups=2), [2, 2]), (dict(groups="list"), [1, 2])):
        models = []
        for wrap in (hs.DistributedOptimizer, hvd.DistributedOptimizer):
            model = mlp(seed=0)
            args = {k: (model_groups(model) if v == "list" else v) for k, v in kwargs.items()}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # num_groups, as in Horovod
                opt = wrap(torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
                           **args)
            if wrap is hs.DistributedOptimizer:
                sizes = sorted(len(m.pieces) for m in opt.plan.messages if m.name.startswith("hybridsync.group"))
                check(sizes == fused, f"{kwargs}: group messages of {sizes} pieces, expected {fused}")
            for step in range(3):
                train_step(model, opt, step)
            models.append(model)
        diff = max_diff(*models)
        check(diff <= 1e-6, f"{kwargs}: parameters differ from Horovod's by {diff}")
    model = mlp(seed=0)
    try:
        hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                groups=[[model[0].weight, model[0].bias]],
                                strategy={"variables": {"0.weight": {"group": 3}, "2.weight": {"group": 3}}})
    except ValueError as e:
        check("0.weight" in str(e) and "groups" in str(e), f"unclear error: {e}")
    else:
        raise AssertionError("groups= together with strategy groups on the same variable was accepted")
    # A frozen parameter is in no group and gets no gradient, as in Horovod.
    model = IndexedScale()
    opt = hs.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                  num_groups=1)
    opt.zero_grad()
    model(torch.ones(2)).sum().backward()
    opt.step()
    check(model.a.grad is None, "num_groups gave the frozen parameter a gradient")


CASES = {
    "broadcast_state_hs": lambda out: broadcast_state("hs", f"{out}.ckpt"),
    "broadcast_state_hvd": lambda out: broadcast_state("hvd", f"{out}.ckpt"),
    "broadcast_state_with_scheduler_hs": lambda out: broadcast_state_with_scheduler("hs"),
    "broadcast_state_with_scheduler_hvd": lambda out: broadcast_state_with_scheduler("hvd"),
    "broadcast_state_options_hs": lambda out: broadcast_state_options("hs"),
    "broadcast_state_options_hvd": lambda out: broadcast_state_options("hvd"),
    "broadcast_state_no_grad_hs": lambda out: broadcast_state_no_grad("hs"),
    "broadcast_state_no_grad_hvd": lambda out: broadcast_state_no_grad("hvd"),
    "force_allreduce": lambda out: force_allreduce(),
    "named_parameters_rules": lambda out: named_parameters_rules(),
    "dynamic_requires_grad": lambda out: dynamic_requires_grad(),
    "gradient_clipping": lambda out: gradient_clipping(),
    "synchronize_step_warning": lambda out: synchronize_step_warning(),
    "sparse_embeddings": lambda out: sparse_embeddings(),
    "optimizer_process_sets": lambda out: optimizer_process_sets(),
    "groups_match_horovod": lambda out: groups_match_horovod(),
}


def main() -> None:
    out = sys.argv[1]
    hs.init()
    results = {}
    for name in sys.argv[2:] or CASES:
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)  # a hang fails the job, with stacks
        try:
            CASES[name](out)
            results[name] = "ok"
        except Exception as e:  # recorded per case; the test names the failing one
            results[name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        finally:
            faulthandler.cancel_dump_traceback_later()
        print(f"rank {hvd.rank()} {name}: {results[name].splitlines()[0]}", flush=True)
    with open(f"{out}.rank{hvd.rank()}.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
