"""Where the build finds torch-model-archiver."""
import os
import stat
import sys

import pytest

from scripts import build_archive


def make_executable(path):
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_archiver_on_path_wins(tmp_path, monkeypatch):
    on_path = make_executable(tmp_path / "torch-model-archiver")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python")
    assert build_archive.archiver() == str(on_path)


def test_archiver_beside_the_interpreter_when_not_on_path(tmp_path, monkeypatch):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    beside = make_executable(venv_bin / "torch-model-archiver")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(sys, "executable", str(venv_bin / "python"))
    assert build_archive.archiver() == str(beside)


def test_no_archiver_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(FileNotFoundError, match="make venv"):
        build_archive.archiver()
    assert not os.listdir(tmp_path)
