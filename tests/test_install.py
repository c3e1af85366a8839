"""A built wheel, installed into a fresh virtual environment, is the whole library.

The editable install used everywhere else reads the source tree, so it cannot notice a
package that setup.py leaves out of the wheel. This test builds a wheel from a copy of the
tree, installs it into a new venv and, from a directory outside the repository with no
PYTHONPATH, imports every module of the source tree and runs every console script.
"""
from __future__ import annotations

import configparser
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "hybridsync"

IMPORT_ALL = REPO / "tests" / "workers" / "import_all.py"
"""Run inside the fresh venv: imports each module and reports where it came from."""


def source_modules() -> list[str]:
    """Dotted names of every module and package under hybridsync/ in the source tree."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.unit
def test_every_package_directory_has_an_init():
    """find_packages() skips a directory without __init__.py, and so does the wheel."""
    missing = [str(d.relative_to(REPO)) for d in [PACKAGE, *PACKAGE.rglob("*")]
               if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert not missing, f"package directories without __init__.py: {missing}"


def _run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def build_wheel(tmp_path: Path) -> Path:
    """Build from a clean copy of the tree: an in-tree build would reuse a stale build/ directory."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    shutil.copytree(PACKAGE, src / "hybridsync", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(src)], cwd=tmp_path)
    (wheel,) = dist.glob("hybridsync-*.whl")
    return wheel


def fresh_venv(tmp_path: Path) -> Path:
    """A new venv that sees this interpreter's installed packages (torch, horovod) but no hybridsync.

    ``venv --system-site-packages`` is not enough when this interpreter is itself a venv:
    the new one would see the base interpreter's site-packages, not this venv's. A ``.pth``
    file naming this interpreter's site directories adds them as plain paths, after the new
    venv's own site-packages; ``.pth`` files inside them (an editable install of the source
    tree) are not processed, so the checkout cannot be imported through them.
    """
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    (purelib,) = venv.glob("lib/python*/site-packages")
    (purelib / "_project_site.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    return venv


def console_scripts(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        (entry_points,) = [n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(zf.read(entry_points).decode())
    return sorted(parser["console_scripts"])


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(wheel, venv, a working directory outside the repository)."""
    tmp_path = tmp_path_factory.mktemp("install")
    wheel = build_wheel(tmp_path)
    venv = fresh_venv(tmp_path)
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
          "--no-index", "-q", str(wheel)], cwd=tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    return wheel, venv, outside


@pytest.mark.multiprocess
def test_wheel_has_every_module_of_the_tree(installed):
    wheel, venv, outside = installed
    expected = source_modules()
    proc = _run([str(venv / "bin" / "python"), str(IMPORT_ALL), json.dumps(expected)], cwd=outside)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {name: where for name, where in report["found"].items()
              if where is None or where.startswith("ERROR") or not Path(where).is_relative_to(venv)}
    assert not failed, f"modules that do not import from the installed wheel: {failed}"
    assert sorted(report["installed"]) == sorted(expected)


@pytest.mark.multiprocess
def test_wheel_console_scripts_run(installed):
    wheel, venv, outside = installed
    scripts = console_scripts(wheel)
    assert {"hybridsync", "hybridsync-run", "hybridsync-server"} <= set(scripts)
    for script in scripts:
        proc = _run([str(venv / "bin" / script), "--help"], cwd=outside, timeout=120)
        assert "usage" in proc.stdout.lower() or script in proc.stdout, (script, proc.stdout[:500])
