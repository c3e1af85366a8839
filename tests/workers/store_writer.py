"""Adds trials to a trial store in a loop, logging each one before and after its transaction.

    python store_writer.py URL PREFIX COUNT LOG [GO]    # COUNT 0: until killed

Each trial's uid starts with PREFIX. LOG gets ``adding <uid> <unix time>`` before
``TrialStore.add`` and ``added <uid>`` once it returned (committed), so a test that kills
this process knows which trials must be in the store and which one was in flight.
With GO, it logs ``ready`` once the store is open and waits for the file GO to exist, so
that several writers start adding at the same moment.
``HYBRIDSYNC_STORE_HOLD_S`` (read by the store) keeps each transaction open that long.
"""
from __future__ import annotations

import itertools
import os
import sys
import time
import uuid

from hybridsync.trials.store import TrialRecord, TrialStore

CLUSTER = {"nodes": 2, "workers_per_node": 2, "inter_node_bandwidth": "1gbit"}


def record(uid: str, index: int) -> TrialRecord:
    return TrialRecord(uid=uid, model="ncf", description_id="0" * 16, cluster=CLUSTER, kind="random",
                       strategy={"version": 1, "default": {}, "variables": {}}, fingerprint=uid[:16],
                       status="ok", reason=None, warmup_steps=2,
                       step_times=[0.5, 0.4] + [0.1 + 0.001 * index] * 8, versions={"hybridsync": "test"},
                       started="2026-01-01T00:00:00+00:00", finished="2026-01-01T00:00:01+00:00",
                       host="test", job="writer")


def main(url: str, prefix: str, count: int, log_path: str, go: str | None) -> None:
    with TrialStore(url) as store, open(log_path, "a", encoding="utf-8", buffering=1) as log:
        if go is not None:
            log.write("ready\n")
            while not os.path.exists(go):
                time.sleep(0.01)
        for index in itertools.count() if count == 0 else range(count):
            uid = prefix + uuid.uuid4().hex
            log.write(f"adding {uid} {time.time()}\n")
            store.add(record(uid, index))
            log.write(f"added {uid}\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] if len(sys.argv) > 5 else None)
