"""Every command a user can type answers --help with its usage (and does no work): each script
under scripts/ as `python <path>` (or `python -m scripts.bench...`), and each console entry point
of pyproject.toml (`llama-tsctl`, ...) as installed by `make venv`. Every argument and sub-command
of every script says what it is for (a `help=`)."""
from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "llama-torchserve"


def commands():
    """(label, how, target) of each script under scripts/ that parses a command line: run as
    ``python <path>`` (how "path") or ``python -m <module>`` (how "module")."""
    found = []
    for path in sorted((ROOT / "scripts").rglob("*.py")):
        runnable = path.name == "__main__.py" or "ArgumentParser(" in path.read_text()
        if not runnable or path.name == "__init__.py":
            continue
        relative = path.relative_to(ROOT)
        if path.parent.name == "bench":
            module = "scripts.bench" if path.name == "__main__.py" else f"scripts.bench.{path.stem}"
            found.append((module, "module", module))
        else:
            found.append((str(relative), "path", str(path)))
    return found


# Runs one script with --help as `python <path>` or `python -m <module>` would (runpy is what -m
# uses), with argparse watched: every argument added without a help text, and every sub-command
# added without one, is listed on stderr's last line. argparse.SUPPRESS counts as help (a
# deliberately hidden option).
HELP_PROBE = r"""
import argparse, json, os, runpy, sys

missing = []
add_argument = argparse._ActionsContainer.add_argument
add_parser = argparse._SubParsersAction.add_parser


def add_argument_with_help(self, *args, **kwargs):
    action = add_argument(self, *args, **kwargs)
    if not action.help:
        name = "/".join(action.option_strings) or action.dest
        missing.append(f"{getattr(self, 'prog', '')} {name}".strip())
    return action


def add_parser_with_help(self, name, **kwargs):
    if not kwargs.get("help"):
        missing.append(f"{self._prog_prefix} {name} (sub-command)")
    return add_parser(self, name, **kwargs)


argparse._ActionsContainer.add_argument = add_argument_with_help
argparse._SubParsersAction.add_parser = add_parser_with_help
how, target = sys.argv[1:3]
sys.argv = [target, "--help"]
try:
    if how == "path":
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exc:
    code = exc.code
sys.stdout.flush()
print("\nWITHOUT-HELP " + json.dumps(missing), file=sys.stderr)
sys.exit(code)
"""


@functools.cache
def run_help(how: str, target: str) -> tuple:
    """(exit code, stdout, stderr before the probe's line, arguments without help) of ``target --help``."""
    result = subprocess.run([sys.executable, "-c", HELP_PROBE, how, target], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    stderr, _, listed = result.stderr.rpartition("\nWITHOUT-HELP ")
    without_help = json.loads(listed) if listed else None
    return result.returncode, result.stdout, stderr, without_help


def declared_entry_points() -> dict:
    """name -> "module:function" of pyproject.toml's [project.scripts] table."""
    text = (ROOT / "pyproject.toml").read_text()
    table = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[)", text, re.M | re.S).group(1)
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.]+:\w+)"', table, re.M))


def installed_entry_points() -> dict:
    return {ep.name: ep for ep in metadata.distribution(DISTRIBUTION).entry_points if ep.group == "console_scripts"}


ENTRY_POINTS = sorted(declared_entry_points())


SCRIPTS = [(how, target) for _, how, target in commands()]
SCRIPT_IDS = [label for label, _, _ in commands()]


@pytest.mark.parametrize("how,target", SCRIPTS, ids=SCRIPT_IDS)
def test_answers_help_with_its_usage(how, target):
    code, stdout, stderr, _ = run_help(how, target)
    assert code == 0, stderr[-2000:]
    assert stdout.startswith("usage:"), stdout[:300]


@pytest.mark.parametrize("how,target", SCRIPTS, ids=SCRIPT_IDS)
def test_every_argument_has_help(how, target):
    code, _, stderr, without_help = run_help(how, target)
    assert without_help is not None, f"the probe did not finish (exit {code}): {stderr[-2000:]}"
    assert without_help == [], f"give these a help= text: {without_help}"


def test_the_help_probe_finds_an_argument_without_help(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import argparse\n"
                      "parser = argparse.ArgumentParser()\n"
                      "parser.add_argument('--said', help='it says')\n"
                      "parser.add_argument('--silent')\n"
                      "group = parser.add_mutually_exclusive_group()\n"
                      "group.add_argument('--quiet', action='store_true')\n"
                      "sub = parser.add_subparsers()\n"
                      "sub.add_parser('go').add_argument('where')\n"
                      "parser.parse_args()\n")
    code, stdout, _, without_help = run_help("path", str(script))
    assert code == 0 and stdout.startswith("usage:")
    assert without_help == ["script.py --silent", "--quiet", "script.py go (sub-command)", "script.py go where"]


def test_the_scripts_are_found():
    labels = [label for label, _, _ in commands()]
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
