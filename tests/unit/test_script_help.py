"""Every command a user can type answers --help with its usage (and does no work): each script
under scripts/ as `python <path>` (or `python -m scripts.bench...`), and each console entry point
of pyproject.toml (`llama-tsctl`, ...) as installed by `make venv`."""
from __future__ import annotations

import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "llama-torchserve"


def commands():
    """(label, argv) of each script under scripts/ that parses a command line."""
    found = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        runnable = path.name == "__main__.py" or "argparse" in path.read_text()
        if not runnable or path.name == "__init__.py":
            continue
        relative = path.relative_to(ROOT)
        if path.parent.name == "bench":
            module = "scripts.bench" if path.name == "__main__.py" else f"scripts.bench.{path.stem}"
            found.append((module, [sys.executable, "-m", module]))
        else:
            found.append((str(relative), [sys.executable, str(path)]))
    return found


def declared_entry_points() -> dict:
    """name -> "module:function" of pyproject.toml's [project.scripts] table."""
    text = (ROOT / "pyproject.toml").read_text()
    table = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[)", text, re.M | re.S).group(1)
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', table, re.M))


def installed_entry_points() -> dict:
    return {ep.name: ep for ep in metadata.distribution(DISTRIBUTION).entry_points if ep.group == "console_scripts"}


ENTRY_POINTS = sorted(declared_entry_points())


@pytest.mark.parametrize("argv", [argv for _, argv in commands()], ids=[label for label, _ in commands()])
def test_answers_help_with_its_usage(argv):
    result = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[:300]


def test_the_scripts_are_found():
    labels = [label for label, _ in commands()]
    assert "scripts/tsctl.py" in labels and "scripts.bench" in labels and "scripts.bench.measure_continuous" in labels


def test_the_installed_entry_points_are_pyprojects():
    """The editable install is current: a command added to pyproject.toml needs `make venv` to appear."""
    installed = {name: ep.value for name, ep in installed_entry_points().items()}
    assert installed == declared_entry_points()
    assert {"llama-tsctl", "llama-stream", "llama-build", "llama-bench"} <= set(installed)


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_resolves_to_a_callable(name):
    assert callable(installed_entry_points()[name].load())


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_entry_point_answers_help_with_its_usage(name, tmp_path):
    """Run as a user would, from a directory outside the checkout: the command is on the venv's PATH."""
    command = Path(sys.executable).parent / name
    assert command.is_file(), f"{command} is missing: run make venv"
    result = subprocess.run([str(command), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {name} "), result.stdout[:300]
