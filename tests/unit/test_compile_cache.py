"""The shipped compile cache: manifest, verification, read-only model directories."""
import json
import os
import stat

import pytest

from llama_engine import compile_cache as cc

SETTINGS = {"batch_size": 4, "amp": "bf16"}


@pytest.fixture()
def shipped(tmp_path):
    model_dir = tmp_path / "model_dir"
    cache = model_dir / "compile_cache" / "neuronxcc-2.15" / "MODULE_abc+def"
    cache.mkdir(parents=True)
    (cache / "model.neff").write_bytes(b"neff-bytes")
    (cache / "model.done").write_text("")
    cc.write_manifest(model_dir / "compile_cache", cc.INDUCTOR, SETTINGS)
    return model_dir


@pytest.fixture(autouse=True)
def private_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_COMPILE_CACHE_DIR", str(tmp_path / "writable"))
    monkeypatch.delenv(cc.INDUCTOR.env_var, raising=False)


def make_read_only(path):
    for p in [path, *path.rglob("*")]:
        mode = os.stat(p).st_mode
        os.chmod(p, mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def test_manifest_records_versions_settings_and_checksums(shipped):
    manifest = json.loads((shipped / "compile_cache" / "manifest.json").read_text())
    assert manifest["kind"] == "inductor" and manifest["settings"] == SETTINGS
    assert manifest["versions"]["torch"] and manifest["python"]["executable"]
    assert set(manifest["files"]) == {"neuronxcc-2.15/MODULE_abc+def/model.neff", "neuronxcc-2.15/MODULE_abc+def/model.done"}


def test_activate_from_a_read_only_model_dir_points_the_compiler_at_a_writable_mirror(shipped):
    make_read_only(shipped)
    session = cc.activate(str(shipped), "compile_cache", cc.INDUCTOR, SETTINGS, allow_recompile=False)
    assert os.environ[cc.INDUCTOR.env_var] == str(session.path)
    assert not str(session.path).startswith(str(shipped))
    module = session.path / "neuronxcc-2.15" / "MODULE_abc+def"
    assert (module / "model.neff").read_bytes() == b"neff-bytes"
    (module / "new.lock").write_text("")  # compilers may write next to the entries
    assert session.shipped == 1 and session.new_entries() == []
    (session.path / "neuronxcc-2.15" / "MODULE_new+def").mkdir()
    assert session.new_entries() == ["neuronxcc-2.15/MODULE_new+def"]
    assert session.report()["new_entries"] == 1


def test_tampered_file_is_refused_with_the_fix(shipped):
    (shipped / "compile_cache" / "neuronxcc-2.15" / "MODULE_abc+def" / "model.neff").write_bytes(b"evil")
    with pytest.raises(cc.CompileCacheError, match=r"checksum mismatch.*model\.neff(.|\n)*make build MODEL="):
        cc.activate(str(shipped), "compile_cache", cc.INDUCTOR, SETTINGS, allow_recompile=False)


def test_missing_file_is_refused(shipped):
    (shipped / "compile_cache" / "neuronxcc-2.15" / "MODULE_abc+def" / "model.done").unlink()
    with pytest.raises(cc.CompileCacheError, match="missing cache file"):
        cc.activate(str(shipped), "compile_cache", cc.INDUCTOR, SETTINGS, allow_recompile=False)


def test_version_mismatch_says_what_differs(shipped, monkeypatch):
    monkeypatch.setattr(cc, "package_version", lambda dist, module: "9.9.9" if dist == "torch" else
                        __import__("importlib.metadata").metadata.version(dist))
    with pytest.raises(cc.CompileCacheError, match=r"torch: compiled with .*, installed 9\.9\.9"):
        cc.activate(str(shipped), "compile_cache", cc.INDUCTOR, SETTINGS, allow_recompile=False)


def test_settings_mismatch_says_what_differs(shipped):
    with pytest.raises(cc.CompileCacheError, match=r"setting batch_size: compiled with 4, configured 8"):
        cc.activate(str(shipped), "compile_cache", cc.INDUCTOR, {**SETTINGS, "batch_size": 8}, allow_recompile=False)


def test_no_shipped_cache(tmp_path):
    with pytest.raises(cc.CompileCacheError, match="no manifest.json"):
        cc.activate(str(tmp_path), "compile_cache", cc.INDUCTOR, SETTINGS, allow_recompile=False)


def test_allow_recompile_compiles_into_a_fresh_directory_instead(shipped):
    session = cc.activate(str(shipped), "compile_cache", cc.INDUCTOR, {**SETTINGS, "batch_size": 8},
                          allow_recompile=True)
    assert session.shipped == 0 and os.environ[cc.INDUCTOR.env_var] == str(session.path)
