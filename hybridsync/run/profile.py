"""``hybridsync profile``: run a training script on one process and write its model description.

    hybridsync profile [--steps N] [--warmup W] [--timeout S] -o desc.json -- python train.py ...

The command runs as one process, no launcher (``hvd.init()`` works with size 1), with
``HYBRIDSYNC_PROFILE`` set: its ``hybridsync.DistributedOptimizer`` profiles W warm-up and
N measured steps, writes the description and ends the process (``hybridsync.hooks.profiler``).
Torch-free: this side only starts the script, bounds it in time and reads what it wrote.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from typing import Mapping, Sequence

from hybridsync import envvars
from hybridsync.description import ModelDescription, description_id, load_description, save_description
from hybridsync.run.procs import run_bounded

DEFAULT_TIMEOUT_S = 600.0
_OUTPUT_TAIL_LINES = 30


class ProfileFailed(RuntimeError):
    """The profiled command failed, hung, or ended without writing a description."""


def profile_command(command: Sequence[str], *, output: str | os.PathLike,
                    steps: int = envvars.PROFILE_STEPS_DEFAULT, warmup: int = envvars.PROFILE_WARMUP_DEFAULT,
                    timeout: float = DEFAULT_TIMEOUT_S, name: str | None = None, batch_size: int | None = None,
                    env: Mapping[str, str] | None = None) -> ModelDescription:
    """Run ``command`` as one profiled process (at most ``timeout`` s) and write its description to ``output``.

    ``name`` and ``batch_size`` are recorded as given (the profiler cannot know them); without a
    ``name``, ``default_name``: the script's name and its variables' digest (the name an autotune
    stores its trials under: a store shared by two nameless models must not mix their trials).
    ``output`` is replaced only by a complete, valid description. Raises ``ProfileFailed``.
    """
    if not command:
        raise ValueError("no command to profile: give it after --, e.g. -- python train.py")
    output = os.path.abspath(output)
    os.makedirs(os.path.dirname(output), exist_ok=True)  # else the script fails only once it has profiled
    written = f"{output}.profiling-{os.getpid()}"  # the script's cwd may differ: an absolute path
    child_env = {**(os.environ if env is None else env), envvars.PROFILE: written,
                 envvars.PROFILE_STEPS: str(steps), envvars.PROFILE_WARMUP: str(warmup)}
    try:
        try:
            proc = run_bounded(command, timeout=timeout, env=child_env)
        except subprocess.TimeoutExpired as e:
            raise ProfileFailed(f"the command did not finish within {timeout:g} s (raise --timeout, or lower "
                                f"--warmup/--steps); its last output:\n{_tail(e.output)}") from None
        if proc.returncode != 0:
            raise ProfileFailed(f"the command failed with exit code {proc.returncode}; its last output:\n"
                                f"{_tail(proc.stdout)}")
        if not os.path.exists(written):
            raise ProfileFailed(f"the command finished (exit code 0) without writing a description: did it wrap "
                                f"its optimizer in hybridsync.DistributedOptimizer, and run at least "
                                f"{warmup + steps} steps ({warmup} warm-up + {steps})? Its last output:\n"
                                f"{_tail(proc.stdout)}")
        desc = load_description(written)
    finally:
        if os.path.exists(written):
            os.remove(written)
    if batch_size is not None and desc.timing is not None:
        desc = dataclasses.replace(desc, timing=dataclasses.replace(desc.timing, batch_size=batch_size))
    desc = dataclasses.replace(desc, name=name if name is not None else default_name(command, desc))
    save_description(desc, output)
    return desc


def script_name(command: Sequence[str]) -> str:
    """A name for this command: the script's (``train``), or the module's."""
    words = list(command)
    if "-m" in words[:-1]:
        return words[words.index("-m") + 1].rpartition(".")[2]
    scripts = [w for w in words if w.endswith(".py")]
    return os.path.splitext(os.path.basename(scripts[0] if scripts else words[0]))[0]


def default_name(command: Sequence[str], desc: ModelDescription) -> str:
    """``<script>-<8 hex digits of the variables' names, shapes, dtypes and sparsity>``: the trials of one
    script's model share a name in a store across runs (its timing varies), another model's do not."""
    canonical = json.dumps(sorted((name, list(info.shape), info.dtype, info.sparse)
                                  for name, info in desc.variables.items()))
    return f"{script_name(command)}-{hashlib.sha256(canonical.encode('utf-8')).hexdigest()[:8]}"


def _tail(output: str | bytes | None) -> str:
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    lines = (output or "").rstrip().splitlines()[-_OUTPUT_TAIL_LINES:]
    return "\n".join(f"  | {line}" for line in lines) or "  | (no output)"


def summary(desc: ModelDescription, path: str) -> str:
    """A few lines saying what a profiled description holds."""
    variables = desc.variables.values()
    sparse = sum(v.sparse for v in variables)
    lines = [f"wrote {path} (id {description_id(desc)}): {len(desc.variables)} variables ({sparse} sparse), "
             f"{sum(v.nbytes for v in variables) / 1e6:.2f} MB"]
    if desc.timing is not None:
        t = desc.timing
        lines.append(f"  per step, median of {t.steps}: forward {t.forward_s * 1e3:.2f} ms, backward "
                     f"{t.backward_s * 1e3:.2f} ms, optimizer {t.optimizer_s * 1e3:.2f} ms, "
                     f"whole step {t.step_s * 1e3:.2f} ms")
    if desc.variable_timing:
        order = sorted(desc.variable_timing.items(), key=lambda item: item[1].ready_order)
        (first, t_first), (last, t_last) = order[0], order[-1]
        lines.append(f"  gradients ready after the backward start: first {first} at {t_first.ready_s * 1e3:.2f} ms, "
                     f"last {last} at {t_last.ready_s * 1e3:.2f} ms")
        untimed = [name for name in desc.variables if name not in desc.variable_timing]
        if untimed:
            lines.append(f"  no gradient while profiled: {', '.join(untimed)}")
    return "\n".join(lines)


def _at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text}")
        return value
    return parse


def _run(args: argparse.Namespace) -> int:
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        desc = profile_command(command, output=args.output, steps=args.steps, warmup=args.warmup,
                               timeout=args.timeout, name=args.name, batch_size=args.batch_size)
    except ProfileFailed as e:
        print(f"hybridsync profile: error: {e}", file=sys.stderr, flush=True)
        return 1
    print(summary(desc, args.output))
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``profile`` to the ``hybridsync`` command's subcommands."""
    p = commands.add_parser("profile", help="run a training script on one process; write its model description",
                            description="Run a training script on one process and write its model description.")
    p.add_argument("-o", "--output", required=True, help="where to write the description (JSON)")
    p.add_argument("--steps", type=_at_least(1), default=envvars.PROFILE_STEPS_DEFAULT,
                   help=f"steps to profile (default {envvars.PROFILE_STEPS_DEFAULT})")
    p.add_argument("--warmup", type=_at_least(0), default=envvars.PROFILE_WARMUP_DEFAULT,
                   help=f"unprofiled steps before them (default {envvars.PROFILE_WARMUP_DEFAULT})")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds before the command is killed (default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--name", help="a name for the model, recorded in the description (default: the script's name "
                   "and a digest of its variables, e.g. train-1a2b3c4d; trials are stored under it)")
    p.add_argument("--batch-size", type=_at_least(1), help="samples per step, recorded in the description")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the training command")
    p.set_defaults(func=_run)
