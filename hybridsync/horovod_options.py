"""Horovod's ``DistributedOptimizer`` options, and how hybridsync maps them onto its own concepts.

``SyncOptions`` carries them, checked once, from every front end (``hybridsync.DistributedOptimizer``,
``hybridsync.tensorflow``'s tape and Keras optimizer) to the optimizer. ``groups``/``num_groups``
become merge groups of the routing plan, ``process_set`` restricts the ring all-reduce to a
subset of ranks, and ``broadcast_optimizer_state`` resumes from a checkpoint restored on one
rank only. Kept apart from ``optimizer.py`` so that the optimizer reads as Horovod's
hook/synchronize/step contract.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import warnings
from typing import Any, Sequence

import torch

from hybridsync.compression import Compression
from hybridsync.frameworks import Average, check_op, horovod_torch
from hybridsync.router.plan import RoutingPlan, shard_bounds
from hybridsync.strategy import Strategy, resolve_strategy

_TORCH_OPTIM_DIR = os.path.dirname(inspect.getfile(torch.optim.Optimizer)) + os.sep
"""torch's ``torch/optim/`` folder: its wrappers of ``step()`` (the optimizer's hooks and profiling, an LR
scheduler's step counter) stand between Horovod's ``broadcast_optimizer_state`` and our ``step()``."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyncOptions:
    """Horovod's arguments of ``DistributedOptimizer`` / ``DistributedGradientTape`` (v0.28.1), plus the
    strategy: what a front end hands the optimizer (``optimizer.wrap``). Make it with ``checked``."""

    compression: Any = Compression.none
    """A compressor with Horovod's interface (``Compression.none``, ``Compression.fp16``, Horovod's own)."""
    backward_passes_per_step: int = 1
    op: int = Average
    gradient_predivide_factor: float = 1.0
    groups: Any = None
    """Horovod's ``groups`` (``num_groups`` folded in): a count, lists of variables, or ``None``."""
    sparse_as_dense: bool = False
    process_set: Any = None
    """``None``: every rank."""
    scale_local_gradients: bool = True
    """TensorFlow's tape: scale the gradients of worker-local variables by 1/size."""
    strategy: Strategy | None = None
    """The resolved strategy (from ``strategy=`` or ``HYBRIDSYNC_STRATEGY``), or ``None``: Horovod's behaviour."""

    @classmethod
    def checked(cls, *, num_groups: int = 0, groups: Any = None, strategy: Any = None, check_members: bool = True,
                **options: Any) -> "SyncOptions":
        """The options, with the mistakes Horovod refuses (and a bad strategy) refused now, not at the
        first step. ``check_members=False`` leaves lists in ``groups`` unchecked (TensorFlow's variables:
        their torch mirrors are checked when the optimizer is built)."""
        made = cls(**options)
        check_arguments(made.op, made.gradient_predivide_factor, made.backward_passes_per_step)
        check_compressor(made.compression)
        if not (isinstance(groups, list) and not check_members):
            groups = normalize_groups(groups, num_groups)
        return dataclasses.replace(made, groups=groups, strategy=resolve_strategy(strategy))

    def with_strategy(self, strategy: Any) -> "SyncOptions":
        """The same options under another strategy (resolved as ``strategy=`` is)."""
        return dataclasses.replace(self, strategy=resolve_strategy(strategy))

    def size(self) -> int:
        """Ranks that synchronize: the process set's, else the job's."""
        if self.process_set is not None:
            return self.process_set.size()
        return horovod_torch("hybridsync").size()


def check_arguments(op: int, gradient_predivide_factor: float, backward_passes_per_step: int) -> None:
    """``ValueError`` for the reduction arguments Horovod refuses, and for Adasum (not supported)."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    check_op(op)
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step!r}")


def check_compressor(compression: Any) -> None:
    """``TypeError`` now for a ``compression`` without Horovod's ``compress``/``decompress``
    (the string ``"fp16"``, say), which Horovod accepts and fails on at the first step."""
    if not (callable(getattr(compression, "compress", None)) and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression must be a compressor such as hybridsync.Compression.fp16 or "
                        f"hvd.Compression.fp16 (with compress and decompress), got {compression!r}")


def normalize_groups(groups: Any, num_groups: int) -> Any:
    """Horovod's rules: ``num_groups`` is the deprecated spelling of an integer ``groups``."""
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning)
        if groups is None:
            groups = num_groups
    if groups is None:
        return None
    if isinstance(groups, list):
        seen: set[int] = set()
        for group in groups:
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in seen:
                    raise ValueError("A parameter can only appear once in groups.")
                seen.add(id(p))
        return groups
    if isinstance(groups, bool) or not isinstance(groups, int) or groups <= 0:
        raise ValueError(f"groups should be a non-negative integer or a list of list of torch.Tensor, got {groups!r}")
    return groups


def grouped_names(groups: Any, param_groups: Sequence[dict], names: dict[Any, str]) -> list[list[str]]:
    """The names of the parameters each Horovod group fuses, as Horovod forms them.

    Only parameters that require a gradient take part (in ``param_groups`` order): an
    integer splits them into that many near-equal consecutive chunks; a list keeps its
    members, and a parameter in no list is a group of its own (i.e. not merged).
    """
    trainable = [p for group in param_groups for p in group["params"] if p.requires_grad]
    if isinstance(groups, int):
        # Horovod's split_list: the first len % groups chunks one longer; more groups than
        # parameters leaves the extra ones empty, i.e. one parameter per group.
        count = min(groups, len(trainable))
        chunks = [trainable[start:stop] for start, stop in shard_bounds(len(trainable), count)] if count else []
    else:
        ids = {id(p) for p in trainable}
        chunks = [[p for p in group if id(p) in ids] for group in groups]
    return [[names[p] for p in chunk] for chunk in chunks if chunk]


def strategy_with_groups(strategy: Strategy | None, groups: list[list[str]]) -> Strategy:
    """``strategy`` with each Horovod group as a merge group of its own (ids past the strategy's own).

    A variable the strategy already puts in a group cannot also be in a Horovod group: which
    one should win is the user's call, so that is a ``ValueError`` naming them.
    """
    strategy = strategy or Strategy()
    clashing = sorted(name for group in groups for name in group if strategy.config_for(name).group is not None)
    if clashing:
        raise ValueError(f"groups/num_groups and the strategy both put variables in merge groups: "
                         f"{', '.join(clashing)}. Give merge groups in one place only (the strategy's "
                         f"'group' key, or the optimizer's groups=/num_groups=).")
    used = [c.group for c in (strategy.default, *strategy.variables.values()) if c.group is not None]
    first = max(used, default=-1) + 1
    variables = dict(strategy.variables)
    for offset, members in enumerate(groups):
        for name in members:
            variables[name] = dataclasses.replace(strategy.config_for(name), group=first + offset)
    return dataclasses.replace(strategy, variables=variables)


def check_process_set(hvd: Any, process_set: Any, plan: RoutingPlan) -> Any:
    """The process set to all-reduce within (Horovod's global set for ``None``).

    Only the ring route can run within a process set: the hierarchical route builds its
    own sets over the whole job and the parameter servers count every rank as a worker.
    """
    if process_set is None or process_set is hvd.global_process_set:
        return hvd.global_process_set
    if getattr(process_set, "process_set_id", None) is None:
        raise ValueError(f"process_set {process_set} is not initialized: pass it to hvd.init(process_sets=...) "
                         f"or add it with hvd.add_process_set() first")
    if process_set.process_set_id == 0:
        return process_set
    others = sorted({f"{piece.var_name} ({m.config.route_name})" for m in plan.messages
                     if m.config.route_name != "allreduce/ring" for piece in m.pieces})
    if others:
        raise ValueError(f"process_set={process_set} restricts synchronization to ranks {process_set.ranks}, "
                         f"which only the ring all-reduce route supports; the strategy routes "
                         f"{', '.join(others)}. Use the global process set, or route them by ring all-reduce.")
    return process_set


def initialize_state_locally(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None) -> None:
    """Give an optimizer with no state its state: zero gradients, one step of the wrapped optimizer.

    What Horovod's ``broadcast_optimizer_state`` does for its own optimizer (sparse
    zeros for ``SparseAdam`` and for SGD on sparse embeddings), with no synchronization:
    the ranks that restored a checkpoint do not take this step.
    """
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    state = optimizer.state_dict()["state"]
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and id(p) not in state:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    wrapped_step(optimizer)


def wrapped_step(optimizer: torch.optim.Optimizer, closure: Any = None) -> Any:
    """``step()`` of the optimizer class a hybridsync optimizer wraps (no synchronization)."""
    return super(optimizer.__class__, optimizer).step(closure)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None) -> None:
    """Horovod's ``broadcast_optimizer_state``, for hybridsync's optimizer too.

    Ranks whose optimizer has no state yet (typically: all but the one that restored a
    checkpoint) create it locally first, without synchronizing, so no rank waits for a
    collective the others never start; then Horovod's function broadcasts the state.
    """
    import horovod.torch as hvd
    if is_hybridsync_optimizer(optimizer) and not optimizer.state_dict()["state"]:
        initialize_state_locally(optimizer, model)
        if not optimizer.state_dict()["state"]:
            # Stateless (e.g. SGD without momentum) on this rank, hence on every rank
            # (same class, same options): Horovod returns here too.
            return
    hvd.broadcast_optimizer_state(optimizer, root_rank, model=model)


def is_hybridsync_optimizer(optimizer: Any) -> bool:
    return getattr(optimizer, "_is_hybridsync", False) is True


def called_from_horovod_state_init() -> bool:
    """True when ``step()`` (the caller) was called by Horovod's ``broadcast_optimizer_state``.

    Horovod's function creates missing optimizer state by setting zero gradients and
    calling ``optimizer.step()``; it steps only the wrapped optimizer when it recognizes
    its own ``DistributedOptimizer`` (by ``__module__``), and ours is not its own. A
    synchronizing step there would start collectives on the ranks without state only,
    and hang. Recognizing that one caller by its code object is exact: no other call of
    ``step()`` is affected, and our class keeps its true module. Frames of torch's own
    ``step()`` wrappers (optimizer hooks, profiling, the one an LR scheduler puts on the optimizer
    to count its steps) in between are skipped.
    """
    functions = sys.modules.get("horovod.torch.functions")
    target = getattr(getattr(functions, "broadcast_optimizer_state", None), "__code__", None)
    if target is None:
        return False
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_OPTIM_DIR):
        frame = frame.f_back
    return frame is not None and frame.f_code is target
