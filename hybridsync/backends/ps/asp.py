"""ASP and SSP on the parameter-server route, as BytePS's asynchronous mode does it.

The worker runs its optimizer locally, then ``push_pull()`` pushes each parameter's delta
since the last pull and replaces the parameter with the server's current value. Under
ASP the answer comes at once; under SSP (``staleness=k``) the server holds it while this
worker is more than ``k`` steps ahead of the slowest worker, so the bound is enforced by
the servers and visible in their counters (``delayed``, ``max_lead_answered``).

    sync = AsyncParameterSync(client, model.named_parameters(), staleness=2)
    for batch in data:
        loss(model, batch).backward(); opt.step(); opt.zero_grad()
        sync.push_pull()
"""
from __future__ import annotations

import time
from typing import Iterable, Mapping

import torch

from hybridsync.backends.base import ParameterSync
from hybridsync.backends.ps.client import PSClient


class AsyncParameterSync(ParameterSync):
    """The parameters of one model kept on the servers under ASP (``staleness=None``) or SSP."""

    def __init__(self, client: PSClient, named_parameters: Iterable[tuple[str, torch.Tensor]], *,
                 staleness: int | None = None, servers: Mapping[str, int] | None = None,
                 namespace: str = "") -> None:
        """``named_parameters`` may be parameters or contiguous views of them (shards along dim 0);
        ``servers`` pins some of them to a server, the rest are balanced by bytes. ``namespace``:
        the prefix (``"<namespace>/"``) of every name, released by ``close()``."""
        if staleness is not None and staleness < 0:
            raise ValueError(f"staleness must be >= 0 (steps a worker may run ahead), got {staleness}")
        self.client = client
        self.staleness = staleness
        self.namespace = namespace
        self.waited_s = 0.0
        """Seconds this worker spent in ``push_pull`` waiting for answers (SSP holds show here)."""
        self._params = [(name, p) for name, p in named_parameters]
        for name, param in self._params:
            if not param.data.is_contiguous():
                raise ValueError(f"parameter {name!r} must be contiguous for asynchronous PS training")
        servers = servers or {}
        client.declare_all([(name, [param.data], servers.get(name)) for name, param in self._params])
        self._pulled = [self._init(name, param) for name, param in self._params]

    def _init(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """Create the parameter's keys (first worker's value wins) and adopt the servers' value."""
        flat = param.data.view(-1)
        chunks = self.client.layout(name, [param.data]).chunks
        calls = [self.client.request(self.client.server_of(chunk.key), "rpc_init_async", timeout=60,
                                     args=(chunk.key, self.client.config.index, flat[chunk.start:chunk.stop].clone(),
                                           self.staleness)) for chunk in chunks]
        for chunk, pulled in zip(chunks, self.client.wait_all(calls, f"the creation of {name}")):
            flat[chunk.start:chunk.stop].copy_(pulled.value)
        return flat.clone()

    def push_pull(self) -> None:
        """Push every parameter's delta since the last pull; adopt the servers' current values."""
        self.client.check_usable()
        started = time.monotonic()
        pending = []
        for (name, param), pulled in zip(self._params, self._pulled):
            flat = param.data.view(-1)
            delta = flat - pulled
            for chunk in self.client.layout(name, [param.data]).chunks:
                pending.append((flat, pulled, chunk,
                                self.client.send(chunk.key, "rpc_push_delta", delta[chunk.start:chunk.stop].clone())))
        results = self.client.wait_all([call for *_, call in pending], "asynchronous push_pull")
        for (flat, pulled, chunk, _), answer in zip(pending, results):
            flat[chunk.start:chunk.stop].copy_(answer.value)
            pulled[chunk.start:chunk.stop].copy_(answer.value)
        self.waited_s += time.monotonic() - started

    def pull(self) -> None:
        """Adopt the servers' current values without pushing (e.g. once every worker's last push is in)."""
        self.client.check_usable()
        self._pulled = [self._init(name, param) for name, param in self._params]

    def close(self) -> None:
        """Stop using these keys: released on the servers once every worker closed them (needs a namespace)."""
        if self.namespace:
            self.client.release(self.namespace)
