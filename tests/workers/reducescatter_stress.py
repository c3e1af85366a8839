"""Repro: Horovod 0.28.1's Gloo reduce-scatter on a process set gives wrong sums or hangs.

    printf 'nodes: 2\nworkers_per_node: 2\ninter_node_bandwidth: 1gbit\n' > /tmp/c.yaml
    PYTHONPATH=. .venv/bin/python -m hybridsync.run.cluster_cli run /tmp/c.yaml --launcher gloo \\
        --timeout 300 -- .venv/bin/python tests/workers/reducescatter_stress.py [MiB] [REPS]

Kept as the record of why ``hybridsync.backends.hierarchical`` does not start with a
reduce-scatter (it all-reduces within the node instead): this runs the reduce-scatter form
of hierarchical all-reduce (reduce-scatter in node, all-reduce of the shard across nodes,
all-gather in node) on 64 MiB straight on Horovod, checking each step's output. It is not a
test of hybridsync and no test runs it; ``tests/test_emulated.py``'s large-message test
checks the backend. Seen on the emulated 2 x 2 cluster (2 CPUs): a wrong intra-node
reduce-scatter (some elements hold a contribution twice) in the 1st or 2nd repetition,
then "Read timeout" a repetition later; 6 repetitions pass with all four ranks on loopback
(horovodrun -H localhost:2,127.0.0.1:2). Prints one line per rank and step; exit status 1
on a wrong value. Use a --timeout: a hang is one of the outcomes.
"""
from __future__ import annotations

import sys

import horovod.torch as hvd
import torch

from hybridsync.backends.hierarchical.layout import layout_from_environment


def main() -> int:
    mib = float(sys.argv[1]) if len(sys.argv) > 1 else 64
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    torch.set_num_threads(1)
    layout = layout_from_environment()
    intra = [hvd.ProcessSet(ranks) for ranks in layout.node_ranks()]
    cross = [hvd.ProcessSet(ranks) for ranks in layout.local_rank_peers()]
    hvd.init(process_sets=intra + cross)
    rank = hvd.rank()
    intra_node, cross_node = intra[rank // layout.local_size], cross[rank % layout.local_size]
    numel = int(mib * 2**20) // 4
    ranks = range(hvd.cross_rank() * hvd.local_size(), (hvd.cross_rank() + 1) * hvd.local_size())
    node_sum, total = float(sum(r + 1 for r in ranks)), float(sum(range(1, hvd.size() + 1)))
    failed = False
    for rep in range(reps):
        value = torch.full((numel,), float(hvd.rank() + 1))
        shard = hvd.synchronize(hvd.reducescatter_async(value, name="rs", op=hvd.Sum, process_set=intra_node))
        reduced = hvd.allreduce(shard, name="ar", op=hvd.Sum, process_set=cross_node)
        full = hvd.allgather(reduced, name="ag", process_set=intra_node)
        for step, out, want in (("reduce-scatter", shard, node_sum), ("cross all-reduce", reduced, total),
                                ("all-gather", full, total)):
            off = int((out != want).sum())
            failed |= off > 0
            verdict = "ok" if not off else (f"{off} of {out.numel()} wrong, {out.min().item()}.."
                                            f"{out.max().item()}, expected {want}")
            print(f"rank {hvd.rank()} rep {rep} {step}: {verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
