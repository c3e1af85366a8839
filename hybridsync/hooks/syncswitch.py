"""Switching the PS variables between BSP and ASP in flight, at a step every rank agrees on.

``DistributedOptimizer`` makes a ``SyncController`` (a step hook) when its strategy has a
dynamic ``sync`` policy. The controller counts steps (a rank's ``optimizer.step()`` calls)
and, after the step a switch is due, installs the other protocol's plan through the
optimizer's ``replace_plan`` (``set_strategy``'s machinery: new keys on the servers, the old
ones released), without a restart:

- ``switch``: the step is fixed by the policy (``switch_at``), identical on every rank.
- ``elastic``: each rank reports each step to server 0 (sent when its backward pass is
  done, answered by the end of the step), where an ``ElasticPolicy`` decides; the answer
  is the schedule of switches, each after a step no rank had reported when it was made.
  Under ASP the ranks run apart: those ahead wait at the switch step for the others.

Entering ASP, each parameter group's ``lr`` is scaled by ``lr_scale`` and ``momentum`` by
``momentum_scale``; returning to BSP undoes that, every rank adopts the servers' current
parameters (every rank's pushes included) and the optimizer state (momentum buffers) is
averaged over the ranks, so BSP restarts from identical replicas. Every switch is
logged with its reason (stderr, the servers' logs) and kept in ``switches``.

Every rank must run the same number of steps (a switch is a collective).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Literal

from hybridsync.hooks.base import StepHook
from hybridsync.strategy import Strategy
from hybridsync.sync_policy import SyncPolicy

Protocol = Literal["bsp", "asp"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SwitchEvent:
    """One switch a rank made."""

    step: int
    """Steps completed before it: steps ``step + 1`` on run ``protocol``."""
    protocol: Protocol
    reason: str


class SyncController(StepHook):
    """One optimizer's Sync-Switch policy on this rank."""

    def __init__(self, optimizer: Any, strategy: Strategy, *, job: str) -> None:
        assert strategy.sync is not None and strategy.sync.dynamic
        import horovod.torch as hvd
        from hybridsync.backends.ps.route import joined_client
        self._hvd = hvd
        self._optimizer = optimizer
        self.policy: SyncPolicy = strategy.sync
        self.strategy = strategy
        self.job = job
        """Names this controller on the servers (every rank makes the same controllers in order)."""
        self.client = joined_client()
        self.num_workers = hvd.size()
        self.rank = hvd.rank()
        self.step = 0
        """Steps this rank completed."""
        self.protocol: Protocol = "bsp"
        self.switches: list[SwitchEvent] = []
        self._lr_scale = self.policy.scale("lr_scale", self.num_workers)
        self._saved_momentum: list[Any] = []
        self._report: Any = None
        self._schedule: list[tuple[int, str, str]] = []
        self._applied = 0
        """Entries of ``_schedule`` already applied (switches happen in schedule order)."""
        if self.policy.policy == "switch":
            self._schedule = [(self.policy.switch_step(), "asp",
                               f"policy 'switch': BSP for the first {self.policy.switch_step()} steps")]

    def before_sync(self) -> None:
        """This rank's backward pass of the step is done: report it (``elastic``), once per step."""
        if self.policy.policy == "elastic" and self._report is None:
            self._report = self.client.call(0, "rpc_sync_report",
                                            (self.job, self.policy.to_dict(), self.rank, self.step + 1), timeout=60)

    def after_step(self) -> bool:
        """The step is complete: count it, learn the schedule, switch if one is due now. Never ends the run."""
        self.before_sync()  # a step without synchronize() (a rank outside the process set) still reports
        self.step += 1
        if self._report is not None:
            self._schedule = self._report.wait()  # the RPC's own timeout bounds it
            self._report = None
        while self._applied < len(self._schedule):
            step, protocol, reason = self._schedule[self._applied]
            if step > self.step:
                break
            if step < self.step:
                raise RuntimeError(f"Sync-Switch: rank {self.rank} learned of the switch after step {step} only "
                                   f"after step {self.step} (a bug: the schedule must reach every rank in time)")
            self._applied += 1
            self.switch(protocol, reason)  # type: ignore[arg-type]
        return False

    def switch(self, protocol: Protocol, reason: str) -> None:
        """Install ``protocol``'s plan now (every rank, after the same step)."""
        if protocol == self.protocol:
            return
        index = len(self.switches)
        for server in range(self.client.config.num_servers):
            self.client.call(server, "rpc_sync_switched",
                             (self.job, self.rank, index, self.step, protocol, reason), timeout=60).wait()
        optimizer = self._optimizer
        if protocol == "asp":
            self._saved_momentum = [group.get("momentum") for group in optimizer.param_groups]
            momentum_scale = self.policy.scale("momentum_scale", self.num_workers)
            for group in optimizer.param_groups:
                group["lr"] *= self._lr_scale
                if group.get("momentum") is not None:
                    group["momentum"] *= momentum_scale
        else:
            self._hvd.barrier()  # every rank's last ASP push is on the servers
            optimizer.pull_parameters()
            self._average_optimizer_state(index)
            self.restore_hyperparameters()
        optimizer.replace_plan(self.strategy.with_ps_protocol(protocol))
        self.protocol = protocol
        self.switches.append(SwitchEvent(step=self.step, protocol=protocol, reason=reason))
        if self.rank == 0:  # every rank switched after this same step: one line says it for the job
            print(f"hybridsync rank 0: PS variables switched to {protocol} after step {self.step} "
                  f"({reason})", file=sys.stderr, flush=True)

    def restore_hyperparameters(self) -> None:
        """Undo the ASP scaling of ``lr`` and ``momentum`` (also when ``set_strategy`` replaces the
        policy while in ASP: the new strategy starts from the user's values)."""
        if self.protocol != "asp":
            return
        for group, momentum in zip(self._optimizer.param_groups, self._saved_momentum):
            group["lr"] /= self._lr_scale
            if momentum is not None:
                group["momentum"] = momentum
        self._saved_momentum = []

    def _average_optimizer_state(self, index: int) -> None:
        """Average every tensor of the optimizer state over the ranks (they diverged under ASP)."""
        import torch
        optimizer = self._optimizer
        for p_index, param in enumerate(optimizer.plan_parameters):
            for key, value in sorted(optimizer.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                    self._hvd.allreduce_(value, op=self._hvd.Average,
                                         name=f"hybridsync.syncswitch.{self.job}.{index}.{p_index}.{key}")

    def server_events(self) -> list[list[dict[str, Any]]]:
        """Every server's log of the switches all ranks made (one list per server)."""
        return [self.client.call(s, "rpc_sync_events", (), timeout=30).wait()
                for s in range(self.client.config.num_servers)]

