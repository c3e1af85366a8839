"""The trial store: every measured trial, in SQLite, addressed by a URL as Optuna's storage is.

    store = TrialStore("sqlite:///trials.db")        # relative to the working directory
    store = TrialStore("sqlite:////data/trials.db")  # absolute
    store = TrialStore("trials.db")                  # a plain file path works too

One ``add`` is one transaction, committed (and synced) before it returns, so a runner that
is killed loses at most the trial it was writing; the file stays consistent (SQLite's
write-ahead log). Only the standard library's ``sqlite3`` is used: no torch, no Horovod.

Sharing a store:

- On one host, any number of runners (e.g. one per emulated cluster) may write to one
  SQLite file at once: the store opens it in WAL mode with a busy timeout, so writers take
  turns and readers never block them.
- Across hosts, do not put the file on NFS or another network file system: SQLite's
  locking is unsafe there. Each host's runner writes its own store; export each with
  ``hybridsync dataset export --store URL -o host.jsonl`` and merge the exports into one
  store with ``hybridsync dataset import a.jsonl b.jsonl --store URL`` (idempotent: a trial
  is known by its ``uid``).

A model profiled again gets a new description id; ``hybridsync dataset redescribe`` points its
stored trials at the new description (``relink``; ``hybridsync.trials.redescribe``). An import
never re-links a trial the store holds already.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import io
import itertools
import json
import os
import sqlite3
import statistics
import time
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, Mapping, Sequence, TextIO

from hybridsync import envvars

DEFAULT_STORE = "sqlite:///trials.db"
"""The store the commands use without ``--store``."""
SCHEMA_VERSION = 1
"""Stored in ``PRAGMA user_version``; a store written by a newer schema is refused."""
BUSY_TIMEOUT_S = 60.0
"""How long a writer waits for another one's transaction before giving up (a trial is one
short transaction, so contention lasts milliseconds; the margin covers a loaded machine)."""
STATUSES = ("ok", "failed")
HOROVOD_KIND = "horovod"
"""``kind`` of the plain ``horovod.torch.DistributedOptimizer`` reference row."""
HOROVOD_FP16_KIND = "horovod-fp16"
"""``kind`` of the reference row with Horovod's own ``compression=hvd.Compression.fp16``."""
LOCAL_KIND = "local-no-sync"
"""``kind`` of the local-step reference row: the model's plain torch optimizer, gradients never
synchronized (every rank trains alone). No strategy can be faster, so it measures the ceiling of
what any strategy can gain on a cluster; it is a benchmark's reference, not a strategy: the
simulator's samples, the job levels and the dataset's summaries leave it out."""
BASELINE_PREFIX = "baseline:"
"""``kind`` of a baseline is ``baseline:<name>`` (``+``-joined when builders coincide)."""
CONTROL_PREFIX = "control:"
"""``kind`` of a control trial is ``control:<kind of the strategy>``: a strategy re-measured in
blocks between a job's candidates, so that jobs can be compared (``hybridsync.trials.levels``)."""
IMPORT_BATCH = 500
"""Rows per transaction of an import (one per row would make large imports slow)."""

SHARING = ("runners on one host may share one SQLite file; SQLite over NFS is unsafe, so across "
           "hosts each runner writes its own store and `hybridsync dataset import` merges their "
           "JSONL exports (`hybridsync dataset export`)")
URL_FORMS = "sqlite:///relative/path.db, sqlite:////absolute/path.db or a plain file path"


def is_control(kind: str) -> bool:
    """Whether a trial of this kind re-measured a control between a job's candidates."""
    return kind.startswith(CONTROL_PREFIX)


def base_kind(kind: str) -> str:
    """The kind of the strategy a trial measured, without the ``control:`` of a control trial."""
    return kind.removeprefix(CONTROL_PREFIX)


def is_local(kind: str) -> bool:
    """Whether a trial of this kind measured the local step (``LOCAL_KIND``), not a strategy."""
    return base_kind(kind) == LOCAL_KIND


def quantile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, interpolated linearly (numpy's default)."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def relative_spread(values: list[float]) -> float | None:
    """(p90 - p10) / median of ``values`` (``None`` if empty or the median is not positive)."""
    if not values:
        return None
    median = statistics.median(values)
    return (quantile(values, 0.9) - quantile(values, 0.1)) / median if median > 0 else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One measured strategy: what ran where, and every step's time."""

    uid: str
    """uuid4 hex; the primary key (an import skips uids the store already holds)."""
    model: str
    """Zoo model name, e.g. ``"ncf"``."""
    description_id: str
    """Id of the model description the trial used (stored once via ``add_description``)."""
    cluster: dict
    """``ClusterSpec.to_dict()`` of the cluster it ran on."""
    kind: str
    """How the strategy was chosen: ``horovod``, ``baseline:<name>``, ``random``, ``search``...;
    ``control:<kind>`` for a control re-measured between a job's candidates."""
    strategy: dict | None
    """``Strategy.to_dict()``; ``None`` for the ``horovod``, ``horovod-fp16`` and ``local-no-sync``
    reference rows."""
    fingerprint: str
    """``Strategy.fingerprint()``, or ``"horovod"`` / ``"horovod-fp16"`` / ``"local-no-sync"`` for the
    reference rows."""
    status: str
    """``"ok"`` or ``"failed"``."""
    reason: str | None
    """Why it failed (``None`` when ok)."""
    warmup_steps: int
    """Leading entries of ``step_times`` that are warm-up, not timed."""
    step_times: list[float]
    """Seconds per step, warm-up included, slowest rank per step (partial or empty if failed)."""
    versions: dict
    """``{"torch": ..., "horovod": ..., "hybridsync": ..., "runtime": ...}`` of the job (``runtime``:
    ``version.RUNTIME_REVISION``, recorded since revision 2; ``hybridsync.trials.revisions``)."""
    started: str
    """ISO-8601 UTC."""
    finished: str
    """ISO-8601 UTC."""
    host: str
    """Where the runner ran."""
    job: str
    """Id of the job that measured it (one job measures many trials)."""

    def __post_init__(self) -> None:
        errors = []
        if self.status not in STATUSES:
            errors.append(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            errors.append(f"warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in self.step_times):
            errors.append("step_times must be numbers of seconds")
        if not self.uid or not self.fingerprint:
            errors.append("uid and fingerprint must not be empty")
        if errors:
            raise ValueError(f"invalid trial record {self.uid!r}: " + "; ".join(errors))

    @property
    def timed_steps(self) -> list[float]:
        """The step times after the warm-up."""
        return list(self.step_times[self.warmup_steps:])

    @property
    def median_s(self) -> float | None:
        """Median of the timed steps, in seconds (``None`` without timed steps)."""
        timed = self.timed_steps
        return statistics.median(timed) if timed else None

    @property
    def spread(self) -> float | None:
        """(p90 - p10) / median of the timed steps: how noisy the measurement was."""
        return relative_spread(self.timed_steps)

    @property
    def cluster_id(self) -> str:
        return cluster_id(self.cluster)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> "TrialRecord":
        """The record of a ``to_dict`` document; ``ValueError`` naming missing or unknown keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        missing, unknown = sorted(names - set(doc)), sorted(set(doc) - names)
        if missing or unknown:
            raise ValueError(f"trial document: missing keys {missing}, unknown keys {unknown}")
        return cls(**dict(doc))


def cluster_label(cluster: Mapping[str, Any]) -> str:
    """A readable name: ``2x2@1gbit``, plus ``+2ps`` (servers per node) and ``+5ms`` (latency).
    The bandwidth is written in its largest whole unit, so ``1000mbit`` is labelled ``1gbit``."""
    from hybridsync.cluster.spec import BANDWIDTH_UNITS, parse_bandwidth

    bits = parse_bandwidth(str(cluster["inter_node_bandwidth"]))
    unit = next(u for u, size in sorted(BANDWIDTH_UNITS.items(), key=lambda item: -item[1])
                if bits % size == 0 or u == "kbit")
    label = f"{cluster['nodes']}x{cluster['workers_per_node']}@{bits / BANDWIDTH_UNITS[unit]:g}{unit}"
    if cluster.get("servers_per_node"):
        label += f"+{cluster['servers_per_node']}ps"
    if cluster.get("inter_node_latency_ms"):
        label += f"+{cluster['inter_node_latency_ms']:g}ms"
    return label


def cluster_id(cluster: Mapping[str, Any]) -> str:
    """A short stable id of a cluster spec: its label and a hash, e.g. ``2x2@1gbit:3f9c0a1b``.

    Equal specs get equal ids whatever their spelling: defaults are filled in and the
    bandwidth is hashed in bit/s (``1gbit`` == ``1000mbit``).
    """
    from hybridsync.cluster.spec import ClusterSpec

    spec = ClusterSpec.from_dict(cluster)
    canonical = {**spec.to_dict(), "inter_node_bandwidth": spec.inter_node_bits_per_second,
                 "inter_node_latency_ms": float(spec.inter_node_latency_ms)}
    digest = hashlib.sha256(json.dumps(canonical, sort_keys=True).encode("utf-8")).hexdigest()[:8]
    return f"{cluster_label(cluster)}:{digest}"


def store_path(url: str | os.PathLike[str]) -> Path:
    """The SQLite file a store URL (or a path) names; ``ValueError`` for any other kind of URL."""
    if isinstance(url, os.PathLike):
        return Path(url)
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"trial store URL must be a non-empty string ({URL_FORMS}), got {url!r}")
    if "://" not in url:
        return Path(url)
    scheme, rest = url.split("://", 1)
    if scheme.lower() != "sqlite":
        raise ValueError(f"trial store URL {url!r}: only SQLite stores are supported ({URL_FORMS}); "
                         f"to share a store, {SHARING}")
    if not rest.startswith("/") or rest == "/" or "?" in rest or rest == "/:memory:":
        raise ValueError(f"trial store URL {url!r} does not name a file; write {URL_FORMS}")
    return Path(rest[1:])  # sqlite:///a.db -> a.db; sqlite:////abs/a.db -> /abs/a.db


_SCHEMA = """
CREATE TABLE IF NOT EXISTS descriptions (
    description_id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    doc TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS trials (
    uid TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    description_id TEXT NOT NULL,
    cluster_id TEXT NOT NULL,
    cluster_label TEXT NOT NULL,
    cluster TEXT NOT NULL,
    kind TEXT NOT NULL,
    strategy TEXT,
    fingerprint TEXT NOT NULL,
    status TEXT NOT NULL,
    reason TEXT,
    warmup_steps INTEGER NOT NULL,
    step_times TEXT NOT NULL,
    median_s REAL,
    spread REAL,
    versions TEXT NOT NULL,
    started TEXT NOT NULL,
    finished TEXT NOT NULL,
    host TEXT NOT NULL,
    job TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS trials_by_model_cluster ON trials (model, cluster_id, fingerprint);
"""
_JSON_COLUMNS = ("cluster", "strategy", "step_times", "versions")
_RECORD_COLUMNS = tuple(f.name for f in dataclasses.fields(TrialRecord))


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


class TrialStore:
    """Trials and model descriptions in one SQLite file (see the module docstring for URLs
    and for sharing a store between runners)."""

    def __init__(self, url: str | os.PathLike[str], *, create: bool = True) -> None:
        """Opens (and with ``create``, makes) the store at ``url``; ``ValueError`` for a bad URL,
        a missing store when ``create`` is false, or a file that is not a trial store."""
        self.url, self.path = os.fspath(url), store_path(url)
        if not self.path.exists() and not create:
            raise ValueError(f"no trial store at {self.path} (from {url!r})")
        if not self.path.parent.is_dir():
            raise ValueError(f"trial store {url!r}: directory {self.path.parent} does not exist")
        try:
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        except sqlite3.Error as error:
            raise ValueError(f"trial store {url!r}: cannot open {self.path}: {error}") from None
        try:
            self._prepare()
        except BaseException as error:
            self._db.close()
            if isinstance(error, sqlite3.DatabaseError):
                raise ValueError(f"trial store {url!r} ({self.path}) cannot be used: {error}") from None
            raise

    def _prepare(self) -> None:
        mode = self._switch_to_wal()
        if mode != "wal":
            warnings.warn(f"trial store {self.path}: journal mode {mode}, not WAL (writers will block readers)")
        self._db.execute("PRAGMA synchronous=FULL")  # a returned add() survives a power cut too
        if self._db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION:
            return  # the schema is there: opening a store to read it takes no write lock
        with self._transaction() as db:
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ValueError(f"trial store {self.path} has schema version {version}; this hybridsync "
                                 f"reads up to {SCHEMA_VERSION}")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    def _switch_to_wal(self) -> str:
        """``PRAGMA journal_mode=WAL``, retried while another connection holds the lock. Two
        runners opening a fresh store at once both try to convert it, and SQLite answers the
        loser "database is locked" at once instead of calling the busy handler; once the winner
        is done the file is WAL already and the pragma succeeds without a lock."""
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                return self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            except sqlite3.OperationalError as error:
                if "locked" not in str(error) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One transaction, committed on success, rolled back on an exception. IMMEDIATE takes
        the write lock up front (waiting up to the busy timeout): a deferred transaction that
        later wants to write can fail with "database is locked" instead of waiting its turn."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # --- writing ------------------------------------------------------------------------
    def add(self, record: TrialRecord) -> None:
        """Stores one trial in one transaction, committed when this returns."""
        hold_s = envvars.seconds_from_env(envvars.STORE_HOLD_S, 0.0)
        try:
            with self._transaction() as db:
                self._insert(db, record, ignore=False)
                if hold_s:
                    time.sleep(hold_s)  # test hook: a writer killed here must lose only this trial
        except sqlite3.IntegrityError:
            raise ValueError(f"trial {record.uid} is already in the store {self.path}") from None

    def add_description(self, description_id: str, model: str, doc: Mapping[str, Any]) -> None:
        """Stores a model description once (a second call with the same id keeps the first)."""
        with self._transaction() as db:
            db.execute("INSERT OR IGNORE INTO descriptions VALUES (?, ?, ?)", (description_id, model, _dumps(doc)))

    def relink(self, descriptions: Mapping[str, tuple[str, Mapping[str, Any]]]) -> dict[str, int]:
        """Points every trial of each model (key) at a new description ``(description_id, doc)``,
        stored as ``add_description`` stores one, and removes that model's descriptions no trial
        names any more; one transaction for all models. Trials keep everything else (uid, job,
        host, times, step times). Returns the trials re-linked per model. Checking that the new
        description fits the trials is the caller's (``hybridsync.trials.redescribe``)."""
        relinked = {}
        with self._transaction() as db:
            for model, (description_id, doc) in descriptions.items():
                db.execute("INSERT OR IGNORE INTO descriptions VALUES (?, ?, ?)", (description_id, model, _dumps(doc)))
                relinked[model] = db.execute("UPDATE trials SET description_id = ? WHERE model = ? AND "
                                             "description_id != ?", (description_id, model, description_id)).rowcount
            for model, (description_id, _) in descriptions.items():
                db.execute("DELETE FROM descriptions WHERE model = ? AND description_id != ? AND description_id "
                           "NOT IN (SELECT DISTINCT description_id FROM trials)", (model, description_id))
        return relinked

    def replace_job(self, job: str, records: Sequence[TrialRecord]) -> int:
        """Replaces every trial of ``job`` by ``records`` (the job measured again,
        ``hybridsync.trials.remeasure``) in one transaction, and removes the old trials' descriptions
        that no trial names any more. Returns the trials removed; ``ValueError`` if the store holds
        no trial of ``job`` or already holds one of ``records``."""
        with self._transaction() as db:
            old_ids = [row[0] for row in db.execute("SELECT DISTINCT description_id FROM trials WHERE job = ?", (job,))]
            removed = db.execute("DELETE FROM trials WHERE job = ?", (job,)).rowcount
            if not removed:
                raise ValueError(f"trial store {self.path} holds no trial of job {job!r}")
            for record in records:
                if not self._insert(db, record, ignore=True):
                    raise ValueError(f"trial {record.uid} is already in the store {self.path}")
            db.executemany("DELETE FROM descriptions WHERE description_id = ? AND description_id NOT IN "
                           "(SELECT DISTINCT description_id FROM trials)", [(i,) for i in old_ids])
        return removed

    @staticmethod
    def _insert(db: sqlite3.Connection, record: TrialRecord, *, ignore: bool) -> bool:
        row = {name: getattr(record, name) for name in _RECORD_COLUMNS}
        row.update({name: _dumps(row[name]) for name in _JSON_COLUMNS if row[name] is not None})
        row.update(cluster_id=record.cluster_id, cluster_label=cluster_label(record.cluster),
                   median_s=record.median_s, spread=record.spread)
        names = list(row)
        verb = "INSERT OR IGNORE" if ignore else "INSERT"
        cursor = db.execute(f"{verb} INTO trials ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                            [row[name] for name in names])
        return cursor.rowcount == 1

    # --- reading ------------------------------------------------------------------------
    def trials(self, model: str | None = None, cluster: Mapping[str, Any] | str | None = None,
               status: str | None = None) -> list[TrialRecord]:
        """Trials in a stable order (model, cluster, start time), optionally filtered; ``cluster``
        is a spec dict, a ``cluster_id`` or a ``cluster_label``."""
        where, args = self._filters(model, cluster)
        if status is not None:
            where, args = where + ["status = ?"], args + [status]
        sql = (f"SELECT {', '.join(_RECORD_COLUMNS)} FROM trials"
               + (" WHERE " + " AND ".join(where) if where else "")
               + " ORDER BY model, cluster_id, started, uid")
        return [self._record(row) for row in self._db.execute(sql, args)]

    def done_fingerprints(self, model: str, cluster: Mapping[str, Any] | str) -> set[str]:
        """Fingerprints measured (ok or failed) for ``model`` on ``cluster``: what a resumed run skips."""
        where, args = self._filters(model, cluster)
        sql = "SELECT DISTINCT fingerprint FROM trials WHERE " + " AND ".join(where)
        return {row[0] for row in self._db.execute(sql, args)}

    def descriptions(self) -> dict[str, dict[str, Any]]:
        """Description id -> ``{"model", "doc"}``."""
        rows = self._db.execute("SELECT description_id, model, doc FROM descriptions ORDER BY description_id")
        return {did: {"model": model, "doc": json.loads(doc)} for did, model, doc in rows}

    def description_ids(self, model: str) -> set[str]:
        """Ids of the descriptions that ``model``'s trials name (one, unless it was profiled twice)."""
        rows = self._db.execute("SELECT DISTINCT description_id FROM trials WHERE model = ?", (model,))
        return {row[0] for row in rows}

    def count(self) -> int:
        """How many trials the store holds."""
        return self._db.execute("SELECT COUNT(*) FROM trials").fetchone()[0]

    @staticmethod
    def _filters(model: str | None, cluster: Mapping[str, Any] | str | None) -> tuple[list[str], list[Any]]:
        where: list[str] = []
        args: list[Any] = []
        if model is not None:
            where, args = ["model = ?"], [model]
        if isinstance(cluster, Mapping):
            where, args = where + ["cluster_id = ?"], args + [cluster_id(cluster)]
        elif cluster is not None:
            where, args = where + ["(cluster_id = ? OR cluster_label = ?)"], args + [cluster, cluster]
        return where, args

    @staticmethod
    def _record(row: Iterable[Any]) -> TrialRecord:
        values = dict(zip(_RECORD_COLUMNS, row))
        values.update({name: json.loads(values[name]) for name in _JSON_COLUMNS if values[name] is not None})
        return TrialRecord(**values)

    # --- text export / import -----------------------------------------------------------
    def export_jsonl(self, path: str | os.PathLike[str]) -> int:
        """Writes the store as JSON lines, in a deterministic order (descriptions by id, then
        trials by model, cluster, start): one object per line, keys sorted, so two exports
        diff line by line. A path ending in ``.gz`` is gzip-compressed, also deterministically
        (no time stamp or file name in the header): equal stores give equal bytes. Returns the
        number of lines."""
        lines = [_dumps({"type": "description", "description_id": did, **entry})
                 for did, entry in self.descriptions().items()]
        lines += [_dumps({"type": "trial", **record.to_dict()}) for record in self.trials()]
        temporary = f"{os.fspath(path)}.partial"
        with open(temporary, "wb") as raw:
            with _text_writer(raw, gzipped=os.fspath(path).endswith(".gz")) as handle:
                handle.writelines(line + "\n" for line in lines)
        os.replace(temporary, path)  # a crash mid-export never leaves a truncated file behind
        return len(lines)

    def import_jsonl(self, path: str | os.PathLike[str], progress: bool = False) -> tuple[int, int]:
        """Adds the trials (and descriptions) of an export; those already here (same uid) are
        skipped, so importing twice adds nothing. Returns (added, skipped) trial counts.

        Rows are committed in batches; a bad line (``ValueError`` naming file and line) stops
        the import after the batches before it, and importing the fixed file again completes it.
        """
        added = skipped = 0
        for batch in _batches(_read_jsonl(path, progress), IMPORT_BATCH):
            with self._transaction() as db:
                for item in batch:
                    if isinstance(item, TrialRecord):
                        if self._insert(db, item, ignore=True):
                            added += 1
                        else:
                            skipped += 1
                    else:
                        db.execute("INSERT OR IGNORE INTO descriptions VALUES (?, ?, ?)",
                                   (item["description_id"], item["model"], _dumps(item["doc"])))
        return added, skipped

    # --- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "TrialStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _text_writer(raw: BinaryIO, *, gzipped: bool) -> TextIO:
    if not gzipped:
        return io.TextIOWrapper(raw, encoding="utf-8")
    return io.TextIOWrapper(gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0), encoding="utf-8")


def _read_jsonl(path: str | os.PathLike[str], progress: bool) -> Iterator[TrialRecord | dict[str, Any]]:
    """The trials (as records) and descriptions (as dicts) of an export (gzip-compressed if its
    name ends in ``.gz``); ``ValueError`` naming the file and line of the first bad one."""
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        lines: Iterable[str] = handle
        if progress:
            from tqdm import tqdm
            total = sum(1 for _ in handle)
            handle.seek(0)
            lines = tqdm(handle, total=total, desc=f"import {os.path.basename(path)}", unit="row",
                         disable=None)  # None: on a terminal only (an import takes seconds)
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                item = _parse_line(line)
            except (ValueError, KeyError, TypeError) as error:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{os.fspath(path)}:{number}: {error!s}") from None
            yield item


def _parse_line(line: str) -> TrialRecord | dict[str, Any]:
    doc = json.loads(line)
    kind = doc.pop("type", None) if isinstance(doc, dict) else None
    if kind == "trial":
        return TrialRecord.from_dict(doc)
    if kind == "description":
        return {"description_id": str(doc["description_id"]), "model": str(doc["model"]), "doc": doc["doc"]}
    raise ValueError(f"expected an object with type 'description' or 'trial', got {line[:80]!r}")


def _batches(items: Iterable[Any], size: int) -> Iterator[list[Any]]:
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch
