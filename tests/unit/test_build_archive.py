"""Where the build finds torch-model-archiver."""
import os
import stat
import sys
import tarfile
from pathlib import Path

import pytest

from scripts import build_archive

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.fixture
def staged(tmp_path):
    """A prepared model and a compile cache, staged as ``make build`` stages them (no native kernels)."""
    model = tmp_path / "build" / "model"
    model.mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights" * 1000)
    (model / "config.json").write_text("{}")
    cache = tmp_path / "build" / "compile_cache"
    (cache / "graphs").mkdir(parents=True)
    (cache / "graphs" / "step.neff").write_bytes(b"neff")
    return build_archive.stage(model, tmp_path / "build" / "m.stage", compile_cache=cache), model, cache


def same_file(a, b) -> bool:
    return os.stat(a).st_ino == os.stat(b).st_ino


def test_staging_links_the_weights_and_the_cache_instead_of_copying_them(staged):
    stage, model, cache = staged
    assert same_file(stage / "model" / "model.safetensors", model / "model.safetensors")
    assert same_file(stage / "compile_cache" / "graphs" / "step.neff", cache / "graphs" / "step.neff")
    assert (stage / "llama_engine" / "engine.py").is_file() and (stage / "llama_metrics.py").is_file()


def test_a_no_archive_export_links_the_weights_and_the_cache_after_the_archiver(staged, tmp_path, monkeypatch):
    stage, model, _ = staged
    seen = []
    run = build_archive.subprocess.run

    def archiver_sees(cmd, **kwargs):
        packed = Path(cmd[cmd.index("--extra-files") + 1])
        seen.append(sorted(p.name for p in packed.iterdir()))
        return run(cmd, **kwargs)

    monkeypatch.setattr(build_archive.subprocess, "run", archiver_sees)
    target = build_archive.archive("m", ROOT / "model-config" / "tiny-llama.yaml", stage, tmp_path / "store",
                                   "no-archive", build_archive.ARCHIVE_VERSION)
    assert seen == [["llama_engine", "llama_metrics.py"]]  # the weights and the cache never went through it
    assert same_file(target / "model" / "model.safetensors", model / "model.safetensors")
    assert (target / "compile_cache" / "graphs" / "step.neff").read_bytes() == b"neff"
    assert (target / "MAR-INF" / "MANIFEST.json").is_file() and (target / "llama_engine" / "engine.py").is_file()
    assert not stage.with_name(stage.name + ".packed").exists() and (stage / "model").is_dir()


def test_a_tgz_export_packs_the_weights_and_the_cache(staged, tmp_path):
    stage, _, _ = staged
    target = build_archive.archive("m", ROOT / "model-config" / "tiny-llama.yaml", stage, tmp_path / "store", "tgz",
                                   build_archive.ARCHIVE_VERSION)
    with tarfile.open(target) as tar:
        names = tar.getnames()
    assert any(n.endswith("model/model.safetensors") for n in names), names
    assert any(n.endswith("compile_cache/graphs/step.neff") for n in names), names
