"""Joining and leaving the RPC group that servers and workers share."""
from __future__ import annotations

import os
import sys
import threading

from hybridsync import envvars
from hybridsync.backends.ps.config import PSConfig


def server_name(index: int) -> str:
    return f"server{index}"


def worker_name(index: int) -> str:
    return f"worker{index}"


def join(config: PSConfig, *, timeout_s: float) -> None:
    """``rpc.init_rpc`` for this process; fails clearly if the group is incomplete after ``timeout_s``.

    The rendezvous master (server 0) waits for the others with torch's 30-minute default,
    whatever the RPC timeout says, so the join runs in a daemon thread that we stop waiting on.
    """
    from torch.distributed import rpc
    options = rpc.TensorPipeRpcBackendOptions(init_method=config.init_method, rpc_timeout=timeout_s,
                                              num_worker_threads=16, **_transport_options(os.environ))
    errors: list[BaseException] = []

    def init() -> None:
        try:
            rpc.init_rpc(config.name, rank=config.rank, world_size=config.world_size, rpc_backend_options=options)
        except BaseException as e:  # noqa: BLE001 - handed to the joining thread
            errors.append(e)

    joiner = threading.Thread(target=init, name="hybridsync-ps-join", daemon=True)
    joiner.start()
    joiner.join(timeout=timeout_s)
    if joiner.is_alive() or errors:
        why = str(errors[0]).splitlines()[0] if errors else "timed out"
        raise RuntimeError(
            f"{config.name} could not join the parameter-server group at {config.init_method} "
            f"({config.num_servers} servers + {config.num_workers} workers) within {timeout_s:.0f} s: "
            f"{why}; check DMLC_PS_ROOT_URI/DMLC_PS_ROOT_PORT, DMLC_NUM_SERVER, "
            f"DMLC_NUM_WORKER and that every server and worker was started")


TRANSPORT_VAR = envvars.PS_TRANSPORT


def _transport_options(env) -> dict[str, list[str]]:
    """TensorPipe transports from ``HYBRIDSYNC_PS_TRANSPORT``: ``tcp`` (default) or ``auto``.

    ``tcp`` keeps every byte on TCP (TensorPipe's ``uv`` transport, ``basic`` channel).
    ``auto`` lets TensorPipe pick, which between processes of one machine means its shared
    memory transport and CMA channel. Two reasons for the default: on the emulated cluster,
    whose hosts share one kernel, ``auto`` moved tensors between "hosts" with CMA
    (``process_vm_readv``), so not a byte crossed the shaped links; and with ``auto`` a process
    that had joined the servers kept paying for it where ranks share cores: ring steps after a
    switch away from the PS, and BSP push-pulls, were several times slower than on TCP
    (benchmarks/switching.py; benchmarks/RESULTS.md, "switching.py").
    """
    choice = env.get(TRANSPORT_VAR, "tcp").strip().lower() or "tcp"
    if choice == "auto":
        return {}
    if choice == "tcp":
        return {"_transports": ["uv"], "_channels": ["basic"]}
    raise ValueError(f"{TRANSPORT_VAR} must be 'tcp' or 'auto', got {choice!r}")


def leave(*, timeout_s: float) -> None:
    """Graceful ``rpc.shutdown``: waits for every member of the group to leave too."""
    from torch.distributed import rpc
    rpc.shutdown(graceful=True, timeout=timeout_s)


def abandon(code: int, message: str) -> None:
    """Print ``message`` and exit now: a peer is gone, so a graceful shutdown could only hang."""
    print(message, file=sys.stderr, flush=True)

    def close() -> None:
        from torch.distributed import rpc
        try:
            rpc.shutdown(graceful=False)
        except Exception:  # noqa: BLE001 - we are exiting anyway
            pass

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(timeout=3.0)
    os._exit(code)
