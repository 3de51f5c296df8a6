"""Every command a user can type answers --help with its usage (and does no work)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize("argv", [argv for _, argv in commands()], ids=[label for label, _ in commands()])
def test_answers_help_with_its_usage(argv):
    result = subprocess.run([*argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[:300]


def test_the_scripts_are_found():
    labels = [label for label, _ in commands()]
    assert "scripts/tsctl.py" in labels and "scripts.bench" in labels and "scripts/measure_continuous.py" in labels
