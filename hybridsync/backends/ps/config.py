"""Launch settings of the parameter-server route, read from BytePS's environment vocabulary.

A PS job is one ``torch.distributed.rpc`` group: ``num_servers`` server processes take
ranks ``0 .. num_servers-1`` (named ``server0``, ``server1``, ...) and ``num_workers``
worker processes take the ranks after them (``worker0``, ...); a server that is replaced
joins again under a new name and id (``group.py``). Server 0, or its supervisor, hosts
the rendezvous store, so ``DMLC_PS_ROOT_URI``/``DMLC_PS_ROOT_PORT`` is server 0's address.
There is no scheduler process.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, Mapping

from hybridsync import envvars
from hybridsync.placement import DEFAULT_PARTITION_BYTES

Role = Literal["server", "worker"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PSConfig:
    """Where this process sits in a parameter-server job and how keys are cut."""

    role: Role
    """``server`` or ``worker`` (``DMLC_ROLE``)."""
    num_workers: int
    """Worker processes in the job (``DMLC_NUM_WORKER``)."""
    num_servers: int
    """Server processes in the job (``DMLC_NUM_SERVER``)."""
    root_uri: str
    """Host of server 0, which hosts the rendezvous (``DMLC_PS_ROOT_URI``)."""
    root_port: int
    """Rendezvous port on ``root_uri`` (``DMLC_PS_ROOT_PORT``)."""
    index: int
    """This process's server id or worker id (``DMLC_SERVER_ID`` / ``DMLC_WORKER_ID``)."""
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    """Keys are chunks of at most this many bytes (``BYTEPS_PARTITION_BYTES``)."""

    def __post_init__(self) -> None:
        _check(self.role in ("server", "worker"), envvars.DMLC_ROLE, f"must be 'server' or 'worker', got {self.role!r}")
        _check(self.num_workers >= 1, envvars.DMLC_NUM_WORKER, f"must be >= 1, got {self.num_workers}")
        _check(self.num_servers >= 1, envvars.DMLC_NUM_SERVER, f"must be >= 1, got {self.num_servers}")
        _check(bool(self.root_uri), envvars.DMLC_PS_ROOT_URI, "must name the host of server 0")
        _check(0 < self.root_port < 65536, envvars.DMLC_PS_ROOT_PORT, f"must be a port 1..65535, got {self.root_port}")
        _check(self.partition_bytes >= 1, envvars.PARTITION_BYTES, f"must be >= 1, got {self.partition_bytes}")
        count, var = ((self.num_servers, envvars.DMLC_SERVER_ID) if self.role == "server"
                      else (self.num_workers, envvars.DMLC_WORKER_ID))
        _check(0 <= self.index < count, var, f"must be in 0..{count - 1}, got {self.index}")

    @property
    def world_size(self) -> int:
        """Processes in the RPC group: every server and every worker."""
        return self.num_servers + self.num_workers

    @property
    def rank(self) -> int:
        """This process's RPC rank: servers first, then workers."""
        return self.index if self.role == "server" else self.num_servers + self.index

    @property
    def name(self) -> str:
        """This process's RPC name (``server<i>`` or ``worker<i>``)."""
        return f"{self.role}{self.index}"

    @property
    def init_method(self) -> str:
        """The rendezvous address for ``rpc.init_rpc``."""
        return f"tcp://{self.root_uri}:{self.root_port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str], *, role: Role | None = None, index: int | None = None) -> PSConfig:
        """Read the settings from ``env`` (usually ``os.environ``).

        ``role`` overrides ``DMLC_ROLE`` and ``index`` overrides ``DMLC_SERVER_ID`` /
        ``DMLC_WORKER_ID`` (a worker may pass ``hvd.rank()``).
        """
        role = role or _required(env, envvars.DMLC_ROLE)  # type: ignore[assignment]
        _check(role in ("server", "worker"), envvars.DMLC_ROLE,
               f"must be 'server' or 'worker' (hybridsync needs no scheduler), got {role!r}")
        num_servers = _int(env, envvars.DMLC_NUM_SERVER)
        return cls(role=role, num_workers=_int(env, envvars.DMLC_NUM_WORKER), num_servers=num_servers,
                   root_uri=_required(env, envvars.DMLC_PS_ROOT_URI), root_port=_int(env, envvars.DMLC_PS_ROOT_PORT),
                   index=index if index is not None else _index(env, role, num_servers),
                   partition_bytes=_int(env, envvars.PARTITION_BYTES, DEFAULT_PARTITION_BYTES))


def _index(env: Mapping[str, str], role: str, num_servers: int) -> int:
    """Server id (may be omitted with one server) or worker id (falls back to the launcher's rank)."""
    if role == "server":
        if num_servers == 1 and envvars.DMLC_SERVER_ID not in env:
            return 0
        return _int(env, envvars.DMLC_SERVER_ID)
    if envvars.DMLC_WORKER_ID in env:
        return _int(env, envvars.DMLC_WORKER_ID)
    for var in envvars.LAUNCHER_RANKS:  # launchers other than BytePS's
        if var in env:
            return _int(env, var)
    raise ValueError("DMLC_WORKER_ID is not set (nor a launcher rank such as HOROVOD_RANK); "
                     "every PS worker needs its id 0..DMLC_NUM_WORKER-1")


def _required(env: Mapping[str, str], var: str) -> str:
    value = env.get(var, "").strip()
    if not value:
        raise ValueError(f"{var} is not set; the parameter-server route needs it (see BytePS's launch variables)")
    return value


def _int(env: Mapping[str, str], var: str, default: int | None = None) -> int:
    if default is not None and not env.get(var, "").strip():
        return default
    text = _required(env, var)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {text!r}") from None


def _check(ok: bool, var: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{var} {what}")
