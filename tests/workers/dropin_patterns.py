"""Run under ``hybridsync-run --num-servers 2`` (2 ranks): training patterns of real scripts, each
trained with ``horovod.torch.DistributedOptimizer``, with hybridsync's and no strategy, and with
hybridsync's and a mixed strategy (PS, hierarchical, merge groups, partitions).

Usage: python dropin_patterns.py OUT_PREFIX [CASE ...] -> OUT_PREFIX.rank<R>.json, per case and variant
(``horovod``, ``none``, ``mixed``): {"diff_across_ranks", "diff_vs_horovod", "diff_vs_none"} (the largest
parameter difference; a variant compared with those before it that succeeded) or {"error", "trace"}.
"""
from __future__ import annotations

import faulthandler
import functools
import json
import sys
import traceback
from typing import Any, Callable

import horovod.torch as hvd
import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridsync as hs

STEPS = 6
CASE_TIMEOUT_S = 120


def mixed_strategy(shapes: list[tuple[str, tuple[int, ...]]]) -> dict:
    """Every route and shape, cycling over the trained variables (name, shape): PS partitioned, a
    hierarchical merge group, a PS merge group, hierarchical partitioned; the rest ring. (The TensorFlow
    patterns, ``tf_dropin_patterns.py``, use it too.)"""
    variables = {}
    for i, (name, shape) in enumerate(shapes):
        can_split = len(shape) > 0 and shape[0] >= 2
        kind = i % 6
        if kind == 0:
            variables[name] = {"route": "ps", **({"partitions": 2} if can_split else {})}
        elif kind in (1, 2):
            variables[name] = {"route": "allreduce", "algorithm": "hierarchical", "group": 1}
        elif kind in (3, 4):
            variables[name] = {"route": "ps", "group": 2}
        else:
            variables[name] = {"route": "allreduce", "algorithm": "hierarchical",
                               **({"partitions": 2} if can_split else {})}
    return {"version": 1, "default": {"route": "allreduce", "algorithm": "ring"}, "variables": variables}


class Experts(nn.Module):
    """An input layer, three experts and a head; ``expert_of(step)`` picks the expert a rank uses."""

    def __init__(self, expert_of: Callable[[int], int] | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 4)
        self.expert_of = expert_of
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc1(x))
        if self.expert_of is None:
            for expert in self.experts:
                h = torch.relu(expert(h))
        else:
            h = torch.relu(self.experts[self.expert_of(self.step)](h))
        return self.head(h)


def batch(gen: torch.Generator, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(6, 8, generator=gen).to(dtype), torch.randn(6, 4, generator=gen).to(dtype)


def mse_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
    F.mse_loss(model(x), y).backward()


def plain_loop(model: nn.Module, opt, gen: torch.Generator, steps: int = STEPS, *, set_to_none: bool = True,
               before_step: Callable[[int], None] | None = None,
               backward: Callable[[nn.Module, torch.Tensor, torch.Tensor, int], None] = mse_backward) -> None:
    """``steps`` steps, each: ``before_step``, zero the gradients, a batch of this rank's, ``backward``, ``step()``."""
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        model.step = step
        if set_to_none:
            opt.zero_grad()
        else:  # Horovod's zero_grad() takes no set_to_none
            model.zero_grad(set_to_none=False)
        x, y = batch(gen, next(model.parameters()).dtype)
        backward(model, x, y, step)
        opt.step()


# --- the patterns: each trains a fresh model with make(optimizer, model) and returns it ---------------------

def moe_by_rank(make) -> nn.Module:
    """Each rank routes its batch to another expert; expert 2 is used by no rank in some steps."""
    model = Experts(lambda step: (step + hvd.rank()) % 2 * (1 + step % 2))
    return run(model, make, plain_loop)


def layer_on_rank0_only(make) -> nn.Module:
    """Expert 1 is used only on rank 0's batch, in every step."""
    model = Experts(lambda step: 1 if hvd.rank() == 0 else 0)
    return run(model, make, plain_loop)


def freeze_unfreeze(make) -> nn.Module:
    """Expert 0 frozen (requires_grad_(False)) on every rank after step 2, trained again from step 4."""
    model = Experts()

    def toggle(step: int) -> None:
        if step in (2, 4):
            model.experts[0].requires_grad_(step == 4)
    return run(model, make, lambda m, o, g: plain_loop(m, o, g, before_step=toggle))


def unfreeze_late(make) -> nn.Module:
    """Expert 0 frozen when the optimizer is built, trained from step 3 on (progressive unfreezing)."""
    model = Experts()
    model.experts[0].requires_grad_(False)

    def unfreeze(step: int) -> None:
        if step == 3:
            model.experts[0].requires_grad_(True)
    return run(model, make, lambda m, o, g: plain_loop(m, o, g, before_step=unfreeze))


def moe_accumulate(make) -> nn.Module:
    """Routing by rank and step with ``backward_passes_per_step=2``: some experts get one pass's gradient."""
    model = Experts()

    def two_passes(model, x, y, step):
        for micro in range(2):
            model.expert_of = lambda _: (step + micro + hvd.rank()) % 3
            F.mse_loss(model(x[3 * micro:3 * micro + 3]), y[3 * micro:3 * micro + 3]).backward()
    return run(model, make, functools.partial(plain_loop, backward=two_passes), backward_passes_per_step=2)


def empty_batch_on_rank1(make) -> nn.Module:
    """Rank 1 has no data in steps 0 and 3 (its loader ran dry): no backward pass, ``step()`` all the same."""
    def maybe(model, x, y, step):
        if not (hvd.rank() == 1 and step in (0, 3)):
            mse_backward(model, x, y, step)
    return run(Experts(), make, functools.partial(plain_loop, backward=maybe))


def gradient_penalty(make) -> nn.Module:
    """WGAN-GP style: ``torch.autograd.grad(..., create_graph=True)`` w.r.t. the input, its norm in the loss."""
    def penalized(model, x, y, step):
        x.requires_grad_(True)
        out = model(x)
        (grad_x,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (F.mse_loss(out, y) + 0.1 * grad_x.pow(2).sum()).backward()
    return run(Experts(), make, functools.partial(plain_loop, backward=penalized))


def add_param_group_later(make) -> nn.Module:
    """Fine-tuning that adds the head's parameters to the optimizer (``add_param_group``) after 2 steps."""
    model = Experts()

    def loop(model, opt, gen):
        for step in range(STEPS):
            if step == 2:
                opt.add_param_group({"params": list(model.head.parameters()), "lr": 0.05})
            plain_loop(model, opt, gen, steps=1)
    torch.manual_seed(0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    body = [p for n, p in model.named_parameters() if not n.startswith("head.")]
    opt = make(torch.optim.SGD(body, lr=0.1), model)  # named: the whole model's, as scripts pass them
    loop(model, opt, gen)
    return model


def keep_zeroed_grads(make) -> nn.Module:
    """``zero_grad(set_to_none=False)`` with a layer used only on rank 0."""
    model = Experts(lambda step: 1 if hvd.rank() == 0 else step % 3)
    return run(model, make, lambda m, o, g: plain_loop(m, o, g, set_to_none=False))


def autograd_grad(make) -> nn.Module:
    """Gradients from ``torch.autograd.grad``, assigned to ``p.grad`` by hand (no hook fires)."""
    def by_hand(model, x, y, step):
        params = list(model.parameters())
        for p, g in zip(params, torch.autograd.grad(F.mse_loss(model(x), y), params)):
            p.grad = g
    return run(Experts(), make, functools.partial(plain_loop, backward=by_hand))


def retain_graph_twice(make) -> nn.Module:
    """Two backward passes over one graph (``retain_graph``) per step, ``backward_passes_per_step=2``."""
    def twice(model, x, y, step):
        loss = F.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        (0.5 * loss).backward()
    return run(Experts(), make, functools.partial(plain_loop, backward=twice), backward_passes_per_step=2)


def checkpoint_resume(make) -> nn.Module:
    """Adam + StepLR; after 3 steps rank 0 saves, a new model and optimizer resume from rank 0's state
    (loaded on rank 0 only, then broadcast_parameters + broadcast_optimizer_state)."""
    torch.manual_seed(0)
    model = Experts()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    opt = make(torch.optim.Adam(model.parameters(), lr=0.01), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        plain_loop(model, opt, gen, steps=1)
        sched.step()
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "opt": opt.state_dict(),
             "sched": sched.state_dict()}
    model2 = Experts()
    opt2 = make(torch.optim.Adam(model2.parameters(), lr=0.01), model2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
    if hvd.rank() == 0:
        model2.load_state_dict(saved["model"])
        opt2.load_state_dict(saved["opt"])
        sched2.load_state_dict(saved["sched"])
    hvd.broadcast_parameters(model2.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt2, root_rank=0)
    sched2.load_state_dict(hvd.broadcast_object(sched2.state_dict(), root_rank=0))
    for _ in range(3):
        plain_loop(model2, opt2, gen, steps=1)
        sched2.step()
    return model2


def data_parallel_wrapped(make) -> nn.Module:
    """A model wrapped in ``nn.DataParallel`` (names prefixed ``module.``; CPU: a pass-through)."""
    return run(nn.DataParallel(Experts()), make, plain_loop)


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.head(h.mean(dim=(2, 3)))


def channels_last(make) -> nn.Module:
    """A conv net in ``channels_last`` memory format: its conv gradients are not contiguous."""
    model = Conv()

    def loop(model, opt, gen):
        for _ in range(STEPS):
            opt.zero_grad()
            x = torch.randn(4, 3, 9, 9, generator=gen).to(memory_format=torch.channels_last)
            F.mse_loss(model(x), torch.randn(4, 4, generator=gen)).backward()
            opt.step()
    return run(model, make, loop, after_broadcast=lambda m: m.to(memory_format=torch.channels_last))


def float64_model(make) -> nn.Module:
    """``model.double()``."""
    return run(Experts().double(), make, plain_loop)


def bfloat16_model(make) -> nn.Module:
    """``model.bfloat16()``."""
    return run(Experts().bfloat16(), make, plain_loop)


def half_model(make) -> nn.Module:
    """``model.half()``."""
    return run(Experts().half(), make, plain_loop)


def mixed_dtypes(make) -> nn.Module:
    """Experts 0 and 1 in float64, the rest float32: merge groups and PS keys mix dtypes."""
    class Mixed(Experts):
        def forward(self, x):
            h = torch.relu(self.fc1(x)).double()
            h = torch.relu(self.experts[1](torch.relu(self.experts[0](h)))).float()
            return self.head(torch.relu(self.experts[2](h)))
    model = Mixed()
    model.experts[0].double(), model.experts[1].double()
    return run(model, make, plain_loop)


def zero_element_parameter(make) -> nn.Module:
    """A model with a zero-element parameter (an empty bias, a zero-width layer)."""
    class WithEmpty(Experts):
        def __init__(self):
            super().__init__()
            self.empty = nn.Parameter(torch.zeros(0, 4))  # PS, in a merge group, with the mixed strategy
            self.empty_rows = nn.Parameter(torch.zeros(3, 0))  # hierarchical, partitioned

        def forward(self, x):
            return super().forward(x) + self.empty.sum() + self.empty_rows.sum()
    return run(WithEmpty(), make, plain_loop)


def compiled_model(make) -> nn.Module:
    """``torch.compile(model)`` (names prefixed ``_orig_mod.``)."""
    return run(torch.compile(Experts(), backend="eager"), make, plain_loop)


def grad_scaler_clipping(make) -> nn.Module:
    """Horovod's mixed-precision recipe: ``GradScaler``, ``synchronize()``, ``unscale_``, clipping, then
    ``scaler.step`` inside ``skip_synchronize()``; the loss is scaled and the forward in bfloat16 autocast."""
    def loop(model: nn.Module, opt, gen: torch.Generator, steps: int = STEPS) -> None:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(steps):
            opt.zero_grad()
            x, y = batch(gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            scaler.scale(F.mse_loss(out.float(), y)).backward()
            opt.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            with opt.skip_synchronize():
                scaler.step(opt)
            scaler.update()
    return run(Experts(), make, loop)


def lbfgs_closure(make) -> nn.Module:
    """``torch.optim.LBFGS``: ``step(closure)`` evaluates the closure (a backward pass) several times."""
    def loop(model: nn.Module, opt, gen: torch.Generator, steps: int = 3) -> None:
        for step in range(steps):
            x, y = batch(gen)

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)
    model = Experts()
    torch.manual_seed(0)
    return run(model, lambda base, m, **o: make(torch.optim.LBFGS(m.parameters(), lr=0.1, max_iter=3), m, **o), loop)


def weight_norm_parametrized(make) -> nn.Module:
    """``torch.nn.utils.parametrizations.weight_norm`` on two layers: their weights are
    ``parametrizations.weight.original0``/``original1`` (magnitude and direction), recomputed each forward."""
    model = Experts()
    for layer in (model.fc1, model.experts[1]):
        nn.utils.parametrizations.weight_norm(layer)
    return run(model, make, plain_loop)


class Recurrent(nn.Module):
    """An LSTM over a short sequence, multi-head self-attention on its outputs, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.attention = nn.MultiheadAttention(16, 4, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(x.view(x.shape[0], 2, 4).repeat(1, 1, 2))
        h, _ = self.attention(h, h, h)
        return self.head(h.mean(dim=1))


def lstm_attention(make) -> nn.Module:
    """``nn.LSTM`` (weights ``weight_ih_l0`` ...) and ``nn.MultiheadAttention`` (``in_proj_weight``)."""
    return run(Recurrent(), make, plain_loop)


def run(model: nn.Module, make, loop, after_broadcast: Callable[[nn.Module], Any] | None = None,
        **options) -> nn.Module:
    """Train ``model`` from the same start on every rank (Horovod's broadcast needs contiguous
    parameters: ``after_broadcast`` changes their layout after it), each rank on its own data."""
    torch.manual_seed(0)
    for p in model.parameters():  # same start whatever the model was built with
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(p.dtype) * 0.3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if after_broadcast is not None:
        after_broadcast(model)
    gen = torch.Generator().manual_seed(100 + hvd.rank())
    opt = make(torch.optim.SGD(model.parameters(), lr=0.1), model, **options)
    loop(model, opt, gen)
    return model


CASES = {f.__name__: f for f in (moe_by_rank, layer_on_rank0_only, freeze_unfreeze, unfreeze_late, moe_accumulate,
                                 empty_batch_on_rank1, gradient_penalty, add_param_group_later,
                                 keep_zeroed_grads, autograd_grad,
                                 retain_graph_twice, checkpoint_resume, data_parallel_wrapped, channels_last,
                                 float64_model, bfloat16_model, half_model, mixed_dtypes, zero_element_parameter,
                                 compiled_model, grad_scaler_clipping, lbfgs_closure, weight_norm_parametrized,
                                 lstm_attention)}


def maker(kind: str):
    def make(base: torch.optim.Optimizer, model: nn.Module, **options: Any) -> torch.optim.Optimizer:
        named = list(model.named_parameters())
        if kind == "horovod":
            return hvd.DistributedOptimizer(base, named_parameters=named, **options)
        held = {id(p) for group in base.param_groups for p in group["params"]}
        trained = [(n, tuple(p.shape)) for n, p in named if id(p) in held and p.requires_grad]
        strategy = mixed_strategy(trained) if kind == "mixed" else None
        return hs.DistributedOptimizer(base, named_parameters=named, strategy=strategy, **options)
    return make


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().double().clone() for p in model.parameters()]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((float((x - y).abs().max()) for x, y in zip(a, b) if x.numel()), default=0.0)


def run_case(name: str) -> dict:
    out: dict[str, Any] = {}
    results: dict[str, list[torch.Tensor]] = {}
    for kind in ("horovod", "none", "mixed"):
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)
        try:
            results[kind] = params_of(CASES[name](maker(kind)))
            mine = torch.cat([p.flatten() for p in results[kind]])
            theirs = hvd.allgather_object(mine)
            out[kind] = {"diff_across_ranks": float((theirs[0] - theirs[1]).abs().max())}
            for other in ("horovod", "none"):
                if other in results and other != kind:
                    out[kind][f"diff_vs_{other}"] = max_diff(results[kind], results[other])
        except Exception as e:  # noqa: BLE001 - recorded, the report judges it
            out[kind] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
        finally:
            faulthandler.cancel_dump_traceback_later()
        print(f"rank {hvd.rank()} {name}/{kind}: {json.dumps({k: v for k, v in out[kind].items() if k != 'trace'})}",
              flush=True)
    return out


def main() -> None:
    prefix = sys.argv[1]
    hs.init()
    results = {name: run_case(name) for name in sys.argv[2:] or CASES}
    with open(f"{prefix}.rank{hvd.rank()}.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
