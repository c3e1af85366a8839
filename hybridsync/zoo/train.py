"""Train a zoo model as a data-parallel job, timing every step (or describe it: ``--describe``).

    hybridsync-run -np 2 -H localhost:2 --gloo python -m hybridsync.zoo.train --model ncf
    horovodrun -np 2 -H localhost:2 --gloo python -m hybridsync.zoo.train --model vgg --optimizer horovod
    mpirun -np 2 python -m hybridsync.zoo.train --model bert --strategy s.json --json out.json
    python -m hybridsync.zoo.train --model resnet --describe -o resnet.json
    python -m hybridsync.zoo.train --model gen-recsys-3 --describe       # a generated model
    python -m hybridsync.zoo.train --catalogue                           # the generated models, as a table

Every rank trains on its own synthetic batches; ``--warmup`` steps come first, then
``--steps`` timed ones. Rank 0 prints the median step time of the timed steps and the first
and last loss; ``--json`` also writes every step time and loss and each rank's parameter
checksum (ranks that synchronize correctly end with identical parameters).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from typing import Any

import torch

from hybridsync import zoo
from hybridsync.variables import save_model_description
from hybridsync.zoo.base import compute_ms, model_stats, train_step


def parameter_checksum(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in ``named_parameters`` order (buffers such as batch-norm
    running statistics are excluded: they follow each rank's own data)."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def describe(args: argparse.Namespace) -> int:
    """Print the model's synchronization-relevant statistics; write its description with ``-o``."""
    zoo_model = zoo.get(args.model)
    torch.manual_seed(args.seed)
    model = zoo_model.build()
    stats = model_stats(model)
    ms = compute_ms(zoo_model, batch_size=args.batch_size)
    print(f"{zoo_model.name}: {zoo_model.summary}\n"
          f"  parameters {stats['parameters']:,}  bytes {stats['bytes'] / 1e6:.2f} MB "
          f"(dense {stats['dense_bytes'] / 1e6:.2f} MB)  tensors {stats['tensors']}  "
          f"sparse tensors {stats['sparse_tensors']}\n"
          f"  largest 3 tensors hold {stats['largest_share']:.0%} ({', '.join(stats['largest_tensors'])})\n"
          f"  forward+backward {ms:.1f} ms at batch {args.batch_size or zoo_model.batch_size} "
          f"({torch.get_num_threads()} thread(s))")
    if args.output:
        save_model_description(zoo.describe(args.model), args.output)
        print(f"wrote {args.output}")
    return 0


def distributed_optimizer(args: argparse.Namespace, hvd: Any, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` wrapped by hybridsync (strategy ``--strategy``, else ``HYBRIDSYNC_STRATEGY``) or Horovod."""
    if args.optimizer == "horovod":
        return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    import hybridsync as hs
    return hs.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), strategy=args.strategy)


def train(args: argparse.Namespace) -> int:
    """Train ``args.model`` on every rank of the job; rank 0 reports (and writes ``--json``)."""
    if args.optimizer == "horovod" and args.strategy:
        raise ValueError("--strategy needs --optimizer hybridsync (Horovod's optimizer ignores strategies)")
    zoo_model = zoo.get(args.model)  # an unknown name fails before the job starts
    import horovod.torch as hvd
    hvd.init()  # hs.init() is hvd.init()
    torch.manual_seed(args.seed)
    model = zoo_model.build()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = distributed_optimizer(args, hvd, model, zoo_model.optimizer(model, args.lr))
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + hvd.rank())
    step_seconds, losses = [], []
    for _ in range(args.warmup + args.steps):
        batch = zoo_model.make_batch(generator, args.batch_size)
        started = time.perf_counter()
        losses.append(train_step(zoo_model, model, optimizer, batch))
        step_seconds.append(time.perf_counter() - started)
    checksums = hvd.allgather_object(parameter_checksum(model))
    if hvd.rank() == 0:
        report = {"model": zoo_model.name, "optimizer": args.optimizer, "ranks": hvd.size(),
                  "batch_size": args.batch_size or zoo_model.batch_size, "warmup": args.warmup, "steps": args.steps,
                  "median_step_s": statistics.median(step_seconds[args.warmup:]),
                  "first_loss": losses[0], "last_loss": losses[-1], "losses": losses, "step_seconds": step_seconds,
                  "parameter_checksums": checksums}
        print(f"{zoo_model.name} on {hvd.size()} ranks ({args.optimizer}): median step "
              f"{1e3 * report['median_step_s']:.1f} ms over {args.steps} timed steps, loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}, ranks' parameters {'agree' if len(set(checksums)) == 1 else 'DIFFER'}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybridsync.zoo.train", description=__doc__.replace("``", ""),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help=f"a zoo model ({', '.join(zoo.ZOO_MODELS)}) or a generated one "
                                        f"(gen-<family>-<k>, e.g. gen-recsys-7)")
    parser.add_argument("--steps", type=int, default=50, help="timed steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (their times are still written)")
    parser.add_argument("--batch-size", type=int, help="per-rank batch size (default: the model's)")
    parser.add_argument("--lr", type=float, help="SGD learning rate (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization; rank r's data use seed and r")
    parser.add_argument("--strategy", help="strategy file (default: HYBRIDSYNC_STRATEGY, else all-reduce)")
    parser.add_argument("--optimizer", choices=("hybridsync", "horovod"), default="hybridsync")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (ranks share the cores)")
    parser.add_argument("--json", help="rank 0 writes step times, losses and checksums here")
    parser.add_argument("--describe", action="store_true", help="do not train: print statistics and compute time")
    parser.add_argument("-o", "--output", help="with --describe: write the model description JSON here")
    parser.add_argument("--catalogue", action="store_true",
                        help="print the generated models the runtime dataset measures, as a Markdown table")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.catalogue:
        from hybridsync.zoo.generator import catalogue_table
        print(catalogue_table())
        return 0
    if args.model is None:
        parser.error("--model is required (or --catalogue)")
    for flag in ("steps", "warmup", "batch_size", "threads"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "warmup" else 1):
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= {0 if flag == 'warmup' else 1}, got {value}")
    if args.output and not args.describe:
        raise SystemExit("-o/--output goes with --describe (use --json for a training report)")
    torch.set_num_threads(args.threads)
    try:
        return describe(args) if args.describe else train(args)
    except ValueError as e:
        print(f"hybridsync.zoo.train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
