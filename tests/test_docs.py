"""The docs: the site builds in strict mode, every program or command they show is run (or says
why not), the README stays short, and the MPI guide's mpi4py communicator works.

A fenced block is a program or a command when its language is one of ``PROGRAMS``; ``json``,
``yaml`` and ``text`` blocks are data or output. A program block is run unless the line right
before it is ``<!-- not-run: REASON -->``.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import BIN, REPO, WORKERS, every_help, launcher_argv, run_job
from hybridsync.run.procs import run_bounded

DOC_FILES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
PROGRAMS = {"bash": "bash", "sh": "bash", "python": "python"}
"""Languages of blocks that are programs or commands, and what runs them."""
DATA = {"json", "yaml", "text"}
"""Languages of blocks that are data or output: never run."""
NOT_RUN = re.compile(r"^<!-- not-run: (?P<reason>\S.*?) -->$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>[\w-]*)\s*$")
README_MAX_LINES = 250
BLOCK_TIMEOUT_S = 240
"""One block's bound: the longest runnable ones import torch and Horovod on a loaded machine."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    """1-based line of the opening fence."""
    language: str
    code: str
    not_run: str | None
    """The reason given in a ``not-run`` comment right before the block, else None."""

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with the ``not-run`` reason that precedes it."""
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        end = next((i for i in range(index + 1, len(lines)) if lines[i].strip() == "```"), None)
        assert end is not None, f"{path}:{index + 1}: a fenced block is never closed"
        indent = len(opening["indent"])
        previous = lines[index - 1].strip() if index else ""
        reason = match["reason"] if (match := NOT_RUN.match(previous)) else None
        code = "\n".join(line[indent:] for line in lines[index + 1:end]) + "\n"
        blocks.append(Block(path, index + 1, opening["language"], code, reason))
        index = end + 1
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in fenced_blocks(path)]
RUNNABLE = list({(block.language, block.code): block for block in reversed(ALL_BLOCKS)
                 if block.language in PROGRAMS and block.not_run is None}.values())[::-1]
"""Program blocks to run, each distinct one once (the README repeats the getting-started program)."""


def _message_texts() -> str:
    """Every string literal of the package, f-strings with their fields as NUL (module constants
    such as environment variable names resolved), backticks dropped: what messages can say."""
    trees = [ast.parse(path.read_text()) for path in (REPO / "hybridsync").rglob("*.py")]
    assigned = [(node.targets[0].id, node.value) for tree in trees for node in tree.body
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)]
    constants = {name: value.value for name, value in assigned
                 if isinstance(value, ast.Constant) and isinstance(value.value, str)}
    constants |= {name: constants[value.attr] for name, value in assigned  # NAME = envvars.OTHER
                  if isinstance(value, ast.Attribute) and value.attr in constants and name not in constants}

    def field(value: ast.FormattedValue) -> str:
        name = getattr(value.value, "id", None) or getattr(value.value, "attr", None)
        return constants.get(name, "\0") if name and name.isupper() else "\0"

    texts = []
    for node in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append(node.value)
        elif isinstance(node, ast.JoinedStr):
            texts.append("".join(part.value if isinstance(part, ast.Constant) else field(part) for part in node.values))
    return "\n".join(texts).replace("`", "")


@pytest.mark.unit
def test_troubleshooting_quotes_messages_the_code_can_print() -> None:
    """Each message the troubleshooting page's tables quote (first column, ``...`` and ``N``, ``M``,
    ``K``, ``<key>`` standing for what varies) is made of text the package's strings hold, so the
    page cannot keep an error the code no longer raises, or misquote one."""
    texts = _message_texts()
    page = (REPO / "docs" / "guides" / "troubleshooting.md").read_text()
    quoted = [message for row in page.splitlines() if row.startswith("| `")
              for message in re.findall(r"`([^`]+)`", row.split(" | ")[0])]
    assert len(quoted) > 50
    misquoted = []
    for message in quoted:
        message = re.sub(r"^[\w.]+(?:Error|Warning): ", "", message)
        message = re.sub(r"'\.\.\.'|\b[NMK]\b|<key>", "...", message)
        for fragment in message.split("..."):
            fragment = fragment.strip(" ,:;(.").rstrip(" (")
            if len(fragment) >= 14 and fragment not in texts:
                misquoted.append(fragment)
    assert not misquoted, f"docs/guides/troubleshooting.md quotes text no message holds: {misquoted}"


@pytest.mark.multiprocess
def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link or anchor, a page left out of the nav, an API
    reference that does not resolve, or a command whose help fails aborts the build. (A process,
    not an in-process build: mkdocstrings asks git where the sources live.)"""
    site = tmp_path / "site"
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_MKDOCS_2_WARNING": "1"}
    proc = run_bounded([str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(site)],
                       timeout=BLOCK_TIMEOUT_S, env=env, cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-6000:]
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "$ hybridsync-run --help" in cli and "--num-servers" in cli  # the hook ran
    api = (site / "reference" / "torch" / "index.html").read_text()
    assert "set_strategy" in api and "HYBRIDSYNC_STRATEGY" in api  # mkdocstrings rendered docstrings
    environment = (site / "reference" / "environment" / "index.html").read_text()
    assert "<!-- envvars -->" not in environment and "HYBRIDSYNC_PS_JOIN_TIMEOUT" in environment  # its hook ran


def _hook(name: str):
    """A mkdocs hook of ``docs/hooks/``, loaded as the site build loads it."""
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_the_cli_reference_shows_every_command_under_its_own_name() -> None:
    """docs/reference/cli.md holds a ``cli-help`` marker for every command and subcommand, nested
    ones included (a new subcommand, or a flag of one, would otherwise be missing from the
    reference), and each help names the command a user types (run in-process, as the site build
    does, ``hybridsync-server``'s said ``usage: mkdocs``)."""
    page = (REPO / "docs" / "reference" / "cli.md").read_text()
    marked = re.findall(r"^<!-- cli-help: (.+?) -->$", page, flags=re.MULTILINE)
    commands = {*every_help(), "hybridsync-run", "hybridsync-server"}
    assert sorted(marked) == sorted(commands), f"missing: {commands - set(marked)}; unknown: {set(marked) - commands}"
    assert all(help_text.startswith(f"usage: {prog} ") for prog, help_text in every_help().items())
    # run in-process by the hook, as the site build does; its parser took argv[0] for its name
    assert _hook("cli_help").command_help("hybridsync-server").startswith("usage: hybridsync-server ")


ENV_NAME = re.compile(r"\b(?:HYBRIDSYNC|DMLC|BYTEPS)_[A-Z0-9_]*[A-Z0-9]\b")


@pytest.mark.unit
def test_every_environment_variable_is_named_once_and_documented() -> None:
    """The package spells an environment variable only in ``hybridsync/envvars.py`` (elsewhere a
    string that is just a name, ``"HYBRIDSYNC_WAIT"``, would bypass it and be missing from the
    generated reference page); each name there has a docstring, the page's row; and every
    ``HYBRIDSYNC_``/``DMLC_``/``BYTEPS_`` name the docs, README or examples mention is one of them
    (or a build variable of ``tools/``/``scripts/``), so a renamed or removed variable cannot
    linger in a page."""
    rows = _hook("envvars_table").variables()
    named = {name for _, names, _ in rows for name in names}
    assert {"HYBRIDSYNC_STRATEGY", "HYBRIDSYNC_WAIT", "DMLC_NUM_SERVER"} <= named
    assert not [names for _, names, doc in rows if not doc], "envvars.py names without a docstring"
    spelled = [f"{path.relative_to(REPO)}: {node.value}" for path in (REPO / "hybridsync").rglob("*.py")
               if path.name != "envvars.py" for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and ENV_NAME.fullmatch(node.value)]
    assert not spelled, f"use the name from hybridsync.envvars instead: {spelled}"
    build = "\n".join(path.read_text() for folder in ("tools", "scripts") for path in (REPO / folder).rglob("*")
                      if path.is_file() and path.suffix in {"", ".sh", ".py"})
    mentioned = {f"{path.relative_to(REPO)}: {name}"
                 for path in [*DOC_FILES, *(REPO / "examples").rglob("*.py")]
                 for name in ENV_NAME.findall(path.read_text()) if name not in named and name not in build}
    assert not mentioned, f"environment variables hybridsync does not have: {sorted(mentioned)}"


@pytest.mark.unit
def test_the_strategy_key_table_is_the_knob_table() -> None:
    """docs/guides/strategies.md's table of a variable's keys has one row per knob of
    ``hybridsync.knobs.KNOBS`` (the one table the validator reads), with the routes it applies to;
    the page names every top-level key a strategy file may have."""
    from hybridsync import knobs, strategy

    page = (REPO / "docs" / "guides" / "strategies.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)` \| ([\w, ]+) \|", page, flags=re.MULTILINE))
    documented = {key: tuple(knobs.ROUTE_NAMES) if routes == "all" else tuple(routes.split(", "))
                  for key, routes in rows.items()}
    assert documented == {knob.name: knob.routes for knob in knobs.KNOBS}
    assert not [key for key in strategy.TOP_LEVEL_KEYS if f'"{key}"' not in page]


@pytest.mark.unit
def test_the_run_config_keys_are_documented() -> None:
    """Every key of a run config's ``hybridsync:`` section and of its ``autotune:`` entries is named in
    the guides that describe them (clusters, autotuning), as `key` or `key:`."""
    from hybridsync.run import config

    pages = "".join((REPO / "docs" / "guides" / name).read_text() for name in ("clusters.md", "autotuning.md"))
    missing = [key for key in sorted({*config.SECTION_KEYS, *config.AUTOTUNE_KEYS})
               if f"`{key}`" not in pages and f"`{key}:`" not in pages]
    assert not missing, f"run config keys no guide names: {missing}"


def _command_lines(block: Block) -> list[list[str]]:
    """The ``hybridsync``/``hybridsync-run`` command lines of a shell block, as argv, with the docs'
    notation resolved: ``\\``-continued lines joined, ``[--flag VALUE]`` given, ``a|b`` as ``a``,
    ``VAR=value`` and ``sudo`` dropped; overview lines (holding ``...``) left out."""
    lines = []
    for line in block.code.replace("\\\n", " ").splitlines():
        line = re.sub(r"\[([^\]|]*)(\|[^\]]*)?\]", r"\1", line)  # [--a x | --b y] -> --a x
        words = shlex.split(line, comments=True)
        while words and (words[0] == "sudo" or re.match(r"^[A-Z_]+=", words[0])):
            words = words[1:]
        if words[:1] in (["hybridsync"], ["hybridsync-run"]) and "..." not in words:
            lines.append([word if word.startswith("-") else word.split("|")[0] for word in words])
    return lines


@pytest.mark.unit
def test_the_docs_command_lines_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Every ``hybridsync ...`` and ``hybridsync-run ...`` line of the docs' shell blocks, run or not,
    is accepted by the parsers as written (subcommands, flags and their values; hybridsync-run's
    flags and horovodrun's): a renamed or removed flag cannot stay in a page, even in a block that
    needs root or many hosts to run. Nothing is run; relative files resolve as in the block runs."""
    from hybridsync.cli import build_parser
    from hybridsync.run import cluster_cli, launcher
    from hybridsync.strategy import Strategy

    for name in ("examples", "horovodrun_configs", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    Strategy().save(tmp_path / "s.json")  # the file the docs' jobs name
    monkeypatch.chdir(tmp_path)
    commands = [(block, words) for block in ALL_BLOCKS if block.language in ("bash", "sh")
                for words in _command_lines(block)]
    assert len(commands) > 30
    refused = []
    for block, (program, *argv) in commands:
        try:
            if program == "hybridsync-run":
                if not launcher.asks_for_help(argv):
                    launcher.horovodrun_job(launcher.split_argv(argv)[1])
            elif argv[:1] == ["cluster"]:  # everything after "--" is the job's (cluster_cli.main)
                cluster_cli.build_parser().parse_args(argv[1:argv.index("--")] if "--" in argv else argv[1:])
            else:
                build_parser().parse_args(argv)
        except SystemExit as error:
            if error.code:
                why = capsys.readouterr().err.strip().splitlines()[-1]  # the parser's error, after its usage
                refused.append(f"{block.name}: {program} {shlex.join(argv)}: {why}")
        except ValueError as error:
            refused.append(f"{block.name}: {program} {shlex.join(argv)}: {error}")
    assert not refused, "\n".join(refused)


@pytest.mark.unit
def test_every_python_block_compiles() -> None:
    """A python block that is not run (a fragment of a training script) still compiles, so a typo or
    a half-edited line in one cannot wait for a reader to paste it."""
    broken = []
    for block in ALL_BLOCKS:
        if block.language == "python":
            try:
                compile(block.code, block.name, "exec")
            except SyntaxError as error:
                broken.append(f"{block.name}: {error}")
    assert not broken, broken


@pytest.mark.unit
def test_every_block_is_data_a_run_program_or_says_why_not() -> None:
    """Every fence names its language; a ``not-run`` comment stands right before a program block
    (a stray one would excuse nothing); some blocks do run, in the README too."""
    unlabeled = [block.name for block in ALL_BLOCKS if block.language not in {*PROGRAMS, *DATA}]
    assert not unlabeled, f"blocks without a known language ({sorted({*PROGRAMS, *DATA})}): {unlabeled}"
    stray = [block.name for block in ALL_BLOCKS if block.not_run and block.language not in PROGRAMS]
    assert not stray, f"not-run comments before blocks that are not programs: {stray}"
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if line.startswith("<!-- not-run"):
                assert NOT_RUN.match(line), f"{path}:{number}: write <!-- not-run: REASON -->"
                assert number < len(lines) and FENCE.match(lines[number]), \
                    f"{path}:{number}: a not-run comment must be the line right before its block"
    assert any(block.path.name == "README.md" for block in RUNNABLE)
    assert {"bash", "python"} <= {PROGRAMS[block.language] for block in RUNNABLE}


@pytest.mark.unit
def test_the_readme_stays_short() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, \
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail into docs/"


@pytest.mark.unit
def test_the_readme_links_resolve() -> None:
    """The README is read on GitHub, outside the site's strict build: every relative link names an
    existing file, and every anchor into a Markdown file names one of its headings."""
    from markdown.extensions.toc import slugify

    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        if not (REPO / path).exists():
            broken.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), flags=re.MULTILINE)
            if anchor not in {slugify(heading, "-") for heading in headings}:
                broken.append(target)
    assert not broken, f"README.md links to what does not exist: {broken}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", RUNNABLE, ids=[block.name for block in RUNNABLE])
def test_the_block_runs(block: Block, tmp_path: Path) -> None:
    """The block, as a user would paste it: in a fresh directory that holds the repository's
    ``examples/``, ``horovodrun_configs/`` and ``data/``, with the environment's commands first on PATH;
    a python block runs as one process."""
    for name in ("examples", "horovodrun_configs", "data"):
        (tmp_path / name).symlink_to(REPO / name)
    script = tmp_path / ("block.py" if PROGRAMS[block.language] == "python" else "block.sh")
    script.write_text(block.code)
    argv = [sys.executable, str(script)] if script.suffix == ".py" else ["bash", "-euo", "pipefail", str(script)]
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "PYTHONUNBUFFERED": "1"}
    try:
        proc = run_bounded(argv, timeout=BLOCK_TIMEOUT_S, env=env, cwd=str(tmp_path))
    except Exception as error:  # a timeout: the output so far says where it stopped
        pytest.fail(f"{block.name} did not finish within {BLOCK_TIMEOUT_S} s: {error}\n{getattr(error, 'output', '')}")
    assert proc.returncode == 0, f"{block.name} failed (exit {proc.returncode}):\n{block.code}\n{proc.stdout[-4000:]}"


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_hs_init_takes_an_mpi4py_communicator(tmp_path: Path) -> None:
    """``hs.init(comm=...)`` (docs/guides/mpi.md): under ``mpirun -np 2``, a communicator holding
    the world in reverse order becomes the Horovod job, and a step with a partitioning and merging
    strategy averages over it exactly."""
    prefix = tmp_path / "results"
    proc = run_job(launcher_argv("mpirun") + [sys.executable, str(WORKERS / "mpi_subcomm.py"), str(prefix)],
                   timeout=180)
    assert proc.returncode == 0, proc.stdout[-6000:]
    results = [json.loads(Path(f"{prefix}.rank{rank}.json").read_text()) for rank in range(2)]
    for world_rank, result in enumerate(results):
        assert result["world_rank"] == world_rank
        assert (result["rank"], result["size"]) == (1 - world_rank, 2)
        assert result["max_error"] < 1e-6, result
