"""horovodrun as ``hybridsync-run`` starts it: the same program, without TensorFlow's import and start-up log.

Before any rank starts, horovodrun asks whether Horovod was built with Gloo (or MPI) by
importing ``horovod.tensorflow`` in a forked child (``horovod.common.util``). That imports
TensorFlow, 9-26 s of a loaded 2-core machine (``horovod.torch`` alone: 6-7 s), and prints
absl's "All log messages before absl::InitializeLog()" notice, oneDNN's "custom operations
are on" line (twice each) and ``cpu_feature_guard``'s, whether or not the job uses TensorFlow.

Here that check runs first, answered by Horovod's PyTorch extension library, which every
hybridsync job runs on (``hybridsync.tensorflow`` too): a forked child loads it with ctypes,
as ``horovod.torch`` does, but imports neither torch nor TensorFlow, and asks it the build
flag (one CMake configuration builds every extension: they share their flags). Horovod
caches the answer, so horovodrun's own call reuses it and forks nothing. Only if that library
does not load does Horovod's own check run, in a temporary environment:
``TF_CPP_MIN_LOG_LEVEL=1`` (INFO off, warnings and errors still shown) hides
``cpu_feature_guard``'s line and ``TF_ENABLE_ONEDNN_OPTS=0`` the other two, which TensorFlow
prints before it reads its log level (the check computes nothing, so oneDNN's numerics do not
matter to it). The environment is back as it was before horovodrun starts the ranks, so a
TensorFlow user's ranks log (and compute) exactly as under plain horovodrun. A user's own
``TF_CPP_MIN_LOG_LEVEL`` applies to that fallback as it is. Asked for ``--verbose`` or
``--check-build`` output, horovodrun runs its own check, and prints what it prints.

A rank that horovodrun stops (another rank failed) can die in the middle of a line: Horovod's Gloo
launcher forwards that piece without a newline, so its own next line was glued to it
(``[1]<stdout>:rankProcess 1 exit with status code 143.``). Here a forwarded output that ends
inside a line is ended with a newline (``lines_ended``).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from typing import Any, Callable, Iterator, Sequence, TextIO

from hybridsync import envvars
from hybridsync.failure_notes import FailureNote, first_failure

TF_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL"
CHECK_ENVIRONMENT = {TF_LOG_LEVEL: "1", "TF_ENABLE_ONEDNN_OPTS": "0"}
"""What the build check's import of TensorFlow runs with: level 1 keeps its warnings and errors."""


def horovodrun_command() -> list[str]:
    """The argv prefix that runs horovodrun through this module (its arguments follow)."""
    return [sys.executable, "-m", "hybridsync.run.horovodrun"]


def check_build_quietly(argv: Sequence[str]) -> None:
    """Run now the build check horovodrun is about to run for ``argv``, from the PyTorch extension's
    library (TensorFlow's start-up log off if Horovod's own check has to run; a user's own
    ``TF_CPP_MIN_LOG_LEVEL`` is left to apply).

    It mirrors horovodrun 0.28.1's choice (``launch.run_controller``; elastic jobs check Gloo):
    ``--gloo`` checks Gloo, ``--mpi``/``--jsrun`` MPI, neither MPI and then, if MPI is missing,
    Gloo, each with ``verbose=False``, the key under which Horovod caches the answer.
    """
    if {"-cb", "--check-build"} & set(argv):
        return
    from unittest import mock

    from horovod.common import util
    from horovod.runner import launch
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet), \
            mock.patch.object(sys, "argv", ["horovodrun", *argv]):
        try:
            args = launch.parse_args()  # also reads --config-file (its controller: setting)
        except (SystemExit, Exception):  # --help, --version, a mistake: horovodrun answers it next
            return
    if args.verbose:
        return
    elastic = args.host_discovery_script is not None or args.min_num_proc is not None
    with _environment({} if TF_LOG_LEVEL in os.environ else CHECK_ENVIRONMENT), mock.patch.object(
            util, "_check_extension_lambda", _torch_library_first(util._check_extension_lambda)):
        if args.use_gloo or elastic:
            util.gloo_built(verbose=False)
        elif not util.mpi_built(verbose=False) and not (args.use_mpi or args.use_jsrun):
            util.gloo_built(verbose=False)


def _torch_library_first(horovods_check: Callable[..., Any]) -> Callable[..., Any]:
    """Horovod 0.28.1's per-extension check (``util._check_extension_lambda(ext_base_name, fn,
    fn_desc, verbose)``: ``fn`` of the imported extension, in a forked child), answered by
    ``fn`` of the PyTorch extension's library instead, whichever extension Horovod asks about:
    ``horovod_built(fn)``. ``horovods_check`` answers when that library does not load."""
    def check(ext_base_name: str, fn: Callable[[Any], Any], fn_desc: str, verbose: bool) -> Any:
        answer = horovod_built(fn)
        return horovods_check(ext_base_name, fn, fn_desc, verbose) if answer is None else answer
    return check


def horovod_built(fn: Callable[[Any], Any]) -> Any:
    """``fn(basics)`` (e.g. ``basics.gloo_built()``) of Horovod's PyTorch extension library, loaded in a
    forked child (``horovod.common.basics.HorovodBasics``, as ``horovod.torch`` loads it) that imports
    neither torch nor TensorFlow; ``None`` if the library is missing or the child fails."""
    import importlib.util
    import multiprocessing
    import queue

    spec = importlib.util.find_spec("horovod.torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    module_path = os.path.join(spec.submodule_search_locations[0], "mpi_ops.py")

    def ask(answers: Any) -> None:
        from horovod.common.basics import HorovodBasics
        answers.put(fn(HorovodBasics(module_path, "mpi_lib_v2")))

    context = multiprocessing.get_context("fork")  # fn is a lambda: a forked child needs no pickling
    answers = context.Queue()
    child = context.Process(target=ask, args=(answers,), daemon=True)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stderr(quiet):  # a failed load's traceback
        child.start()
        child.join(timeout=60)
    if child.is_alive():
        child.kill()
        child.join()
    if child.exitcode != 0:
        return None
    try:
        return answers.get(timeout=5)
    except queue.Empty:
        return None


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` (and so in forked children) inside the block, as before after it."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def exec_mpirun_in_place(execve: Callable[..., Any] = os.execve, *,
                         before: Callable[[], None] | None = None) -> Callable[..., Any]:
    """``os.execve`` for horovodrun's last act on the MPI path, ``/bin/sh -c "<mpirun ...>"``, as
    ``/bin/sh -c "exec <mpirun ...>"``: the shell replaces itself with mpirun.

    Without it mpirun is the shell's child, which no parent-death signal reaches: ``hybridsync-run``
    killed with SIGKILL took the shell with it (``procs.start`` arms the signal) and left mpirun and
    its ranks training on, orphaned. In place, mpirun keeps this process's pid, session and that
    signal, and on SIGTERM stops its ranks and removes their ``/dev/shm`` segments. A command that
    starts with a variable assignment (``exec`` would take it for the program) is left as it is.
    ``before`` runs first: this process's clean-up, since nothing of it runs after the exec."""
    def in_place(path: str, argv: Sequence[str], env: Any) -> Any:
        if before is not None:
            before()
        argv = list(argv)
        if (path == "/bin/sh" and len(argv) == 3 and argv[1] == "-c" and argv[2].split()
                and "=" not in argv[2].split()[0]):
            argv[2] = "exec " + argv[2]
        return execve(path, argv, env)
    return in_place


_RANK_FAILED = re.compile(r"^Horovod detected that one or more processes exited with non-zero status.*"
                          r"Process name: (?P<rank>\S+)\s+Exit code: (?P<code>\S+)", re.DOTALL)
"""The error Horovod 0.28.1's Gloo launcher raises when a rank fails (``gloo_run.launch_gloo``; the
process name is the rank's index in its host plan, that is its rank)."""


def rank_failure(error: BaseException, cause: FailureNote | None = None) -> str | None:
    """One line for horovodrun's verdict on a failed rank, or ``None`` for any other error. Raised
    out of ``run_commandline``, that verdict printed a 20-line traceback of horovodrun's internals
    after the ranks' own output, which already says what went wrong. ``cause``, the error a rank
    noted (``hybridsync.failure_notes``), is named instead of the first rank to exit, which is
    usually one that only followed it."""
    match = _RANK_FAILED.match(str(error)) if isinstance(error, RuntimeError) else None
    if match is None:
        return None
    if cause is not None:
        return (f"hybridsync-run: error: rank {cause.rank} failed: {cause.error}; horovodrun stopped the others "
                "(the ranks' output above has the traceback)")
    return (f"hybridsync-run: error: rank {match['rank']} exited with status {match['code']}, the first to fail; "
            "horovodrun stopped the others (the ranks' output above says why)")


def lines_ended(forward: Callable[..., None]) -> Callable[..., None]:
    """Horovod 0.28.1's ``safe_shell_exec.prefix_connection(src_connection, dst_stream, ...)``, which
    forwards one rank's output to ``dst_stream`` with each line prefixed, ending with a newline what
    it forwarded last if that ended inside a line (a rank killed mid-line, or one whose last write had
    none): the next line written to the stream, often Horovod's verdict on that rank, starts a line."""
    def forward_ending_lines(src_connection: Any, dst_stream: TextIO, *args: Any, **kwargs: Any) -> None:
        watched = _LastCharacter(dst_stream)
        forward(src_connection, watched, *args, **kwargs)
        if watched.inside_line:
            dst_stream.write("\n")
            dst_stream.flush()
    return forward_ending_lines


class _LastCharacter:
    """A text stream that writes through to another, noting whether its last write ended inside a line."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.inside_line = False

    def write(self, text: str) -> int:
        if text:
            self.inside_line = not text.endswith(("\n", "\r"))
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()


def main() -> None:
    """horovodrun's own entry point, after its build check ran quietly; its ranks note their errors."""
    check_build_quietly(sys.argv[1:])
    from horovod.runner.common.util import safe_shell_exec
    from horovod.runner.launch import run_commandline
    safe_shell_exec.prefix_connection = lines_ended(safe_shell_exec.prefix_connection)  # one thread per rank's stream
    sys.argv[0] = "horovodrun"  # argparse's usage and error lines name the program
    notes = tempfile.mkdtemp(prefix="hybridsync-failures-")
    os.environ[envvars.FAILURE_NOTES] = notes
    os.execve = exec_mpirun_in_place(before=lambda: shutil.rmtree(notes, ignore_errors=True))
    try:
        status = run_commandline()
    except RuntimeError as error:
        line = rank_failure(error, first_failure(notes))
        if line is None:
            raise
        print(line, file=sys.stderr, flush=True)
        sys.exit(1)  # the status the traceback gave
    finally:
        shutil.rmtree(notes, ignore_errors=True)
    sys.exit(status)


if __name__ == "__main__":  # horovodrun's per-rank helpers are spawned: they import this module
    main()
