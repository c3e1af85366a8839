"""Elastic Horovod with hybridsync's optimizer: ``hs.elastic.run`` and ``hs.elastic.TorchState``.

Used as Horovod's own (``horovod.torch.elastic``):

    import hybridsync as hs
    hs.init()
    opt = hs.DistributedOptimizer(opt, named_parameters=model.named_parameters(), strategy="s.json")

    @hs.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...  # steps; state.commit() every few of them

    train(hs.elastic.TorchState(model=model, optimizer=opt, epoch=0))

``run`` and ``ElasticSampler`` are Horovod's. ``TorchState`` is Horovod's, plus one thing:
after every reset (a worker lost or added, ``hvd.shutdown(); hvd.init()`` done) it calls
``rebuild_for_world()`` on each hybridsync optimizer it holds, so that the next step plans
for the new world (``hybridsync.world``), as a worker that joined does at its first step.
"""
from __future__ import annotations

from typing import Any

from horovod.torch.elastic import ElasticSampler, run
from horovod.torch.elastic import TorchState as _HorovodTorchState

from hybridsync.horovod_options import is_hybridsync_optimizer

__all__ = ["ElasticSampler", "TorchState", "run"]


class TorchState(_HorovodTorchState):
    """Horovod's ``TorchState`` (commit, restore, sync of the model, optimizer, sampler and plain
    attributes) that re-plans the hybridsync optimizers it holds at every reset."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model=model, optimizer=optimizer, **kwargs)
        self._replanned = [name for name, value in {"optimizer": optimizer, **kwargs}.items()
                           if is_hybridsync_optimizer(value)]
        """Attributes holding hybridsync optimizers, read at each reset (a user may assign a new one)."""

    def reset(self) -> None:
        """After Horovod re-formed the job: every hybridsync optimizer drops its plan (nothing
        collective here, where a failure would not be recovered); the next step builds the new one."""
        super().reset()
        for name in self._replanned:
            getattr(self, name).rebuild_for_world()
