"""`make help` (and plain `make`) list every target a user types, with what it does."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INTERNAL = {"check-models", "one-model"}  # prerequisites of other targets, not typed by users


def phony_targets() -> set:
    text = (ROOT / "Makefile").read_text()
    return set(re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split())


def listed(*args: str) -> dict:
    out = subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *args], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return dict(line.split(None, 1) for line in out.splitlines() if line.strip())


def test_help_lists_every_user_target_with_a_description():
    targets = listed("help")
    assert set(targets) == phony_targets() - INTERNAL
    assert all(len(description) > 10 for description in targets.values())


def test_plain_make_is_help():
    assert listed() == listed("help")
