"""scripts/tsctl.py: which archive each model name is served from, and what start refuses."""
from __future__ import annotations

import gzip
import os
import re
import time

import pytest

from scripts.tsctl import ROOT, TorchServe, load_models_value, main, read_log, settled


def test_each_name_is_served_from_its_directory_or_archive(tmp_path):
    (tmp_path / "tiny-llama" / "MAR-INF").mkdir(parents=True)
    (tmp_path / "packed.tar.gz").write_bytes(b"")
    (tmp_path / "classic.mar").write_bytes(b"")
    value = load_models_value("tiny-llama, packed,classic", tmp_path)
    assert value == "tiny-llama,packed=packed.tar.gz,classic=classic.mar"


def test_a_model_not_in_the_store_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no model 'llama-2-7b' in .*make build MODEL=llama-2-7b"):
        load_models_value("llama-2-7b", tmp_path)
    with pytest.raises(ValueError, match="no model named"):
        load_models_value(" , ", tmp_path)


def test_start_refuses_an_unbuilt_model_before_starting_anything(tmp_path, capsys):
    rc = main(["start", "--workdir", str(tmp_path / "serve"), "--model-store", str(tmp_path), "--models", "nope"])
    assert rc == 1
    assert "make build MODEL=nope" in capsys.readouterr().err
    assert not (tmp_path / "serve" / "torchserve.pid").exists()


def test_health_of_a_server_that_never_started_is_a_clear_failure(tmp_path, capsys):
    assert main(["health", "--workdir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("unhealthy:")


def test_start_waits_as_long_as_the_slowest_models_startup_timeout(tmp_path):
    import json

    from scripts.tsctl import startup_timeout

    for name, seconds in (("quick", 300), ("neuron-7b", 1800)):
        (tmp_path / name / "MAR-INF").mkdir(parents=True)
        (tmp_path / name / "MAR-INF" / "MANIFEST.json").write_text(json.dumps({"model": {"configFile": f"{name}.yaml"}}))
        (tmp_path / name / f"{name}.yaml").write_text(f"startupTimeout: {seconds}\n")
    (tmp_path / "packed.tar.gz").write_bytes(b"")
    assert startup_timeout("quick", tmp_path) == 600
    assert startup_timeout("quick,neuron-7b,packed=packed.tar.gz", tmp_path) == 1860


def test_workers_get_passive_openmp_threads_that_spin_briefly_unless_the_caller_says_otherwise(tmp_path, monkeypatch):
    from scripts.tsctl import TorchServe

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    env = TorchServe(tmp_path, tmp_path).env()
    assert (env["OMP_WAIT_POLICY"], env["GOMP_SPINCOUNT"]) == ("PASSIVE", "20000")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert TorchServe(tmp_path, tmp_path).env()["GOMP_SPINCOUNT"] == "0"


def test_the_server_runs_this_interpreters_torchserve_and_python(tmp_path, monkeypatch):
    """``.venv/bin/python scripts/tsctl.py start`` without the venv on PATH still finds its torchserve."""
    import sys
    from pathlib import Path

    from scripts.tsctl import TorchServe

    monkeypatch.setenv("PATH", "/usr/bin")
    path = TorchServe(tmp_path / "serve", tmp_path, base_config=None).env()["PATH"].split(":")
    assert path == [str(Path(sys.executable).parent), "/usr/bin"]


def test_the_log_config_of_config_properties_is_found_from_the_servers_work_directory(tmp_path):
    """TorchServe starts in its work directory: config.properties' relative log4j2.xml is made absolute,
    a URI or another JVM argument is kept, and the temp directory is added."""
    vmargs = TorchServe(tmp_path / "serve", tmp_path).props["vmargs"].split()
    assert vmargs == [f"-Dlog4j.configurationFile={ROOT / 'log4j2.xml'}", "-XX:TieredStopAtLevel=1",
                      f"-Djava.io.tmpdir={tmp_path / 'serve' / 'tmp'}"]
    assert (ROOT / "log4j2.xml").is_file()
    custom = tmp_path / "custom.properties"
    custom.write_text("vmargs=-Xmx2g -Dlog4j.configurationFile=file:///etc/ts/log4j2.xml\n")
    vmargs = TorchServe(tmp_path / "serve", tmp_path, base_config=custom).props["vmargs"].split()
    assert vmargs[:2] == ["-Xmx2g", "-Dlog4j.configurationFile=file:///etc/ts/log4j2.xml"]
    assert TorchServe(tmp_path / "serve", tmp_path, base_config=None).props["vmargs"].startswith("-Djava.io.tmpdir=")


def test_the_frontend_cpu_bench_reads_process_cpu_and_serves_torchserves_default_logging_beside(tmp_path):
    """scripts/bench/frontend_cpu.py: /proc CPU seconds, and the properties that drop log4j2.xml only."""
    import os
    import time

    from scripts.bench.frontend_cpu import children, cpu_seconds, default_logging_config
    from scripts.tsctl import read_properties

    before, deadline = cpu_seconds(os.getpid()), time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert cpu_seconds(os.getpid()) - before >= 0.1
    assert os.getpid() in children(os.getppid())
    path = default_logging_config(tmp_path / "default")
    props, ours = read_properties(path), read_properties(ROOT / "config.properties")
    assert props["vmargs"] == "-XX:TieredStopAtLevel=1" and {**props, "vmargs": ours["vmargs"]} == ours
    vmargs = TorchServe(tmp_path / "serve", tmp_path, base_config=path).props["vmargs"]
    assert "log4j" not in vmargs and "-XX:TieredStopAtLevel=1" in vmargs  # only the logging differs
    assert (tmp_path / "default" / "metrics.yaml").is_file()


def test_stopping_a_group_this_process_started_reaps_its_leader(tmp_path):
    """``tsctl start`` and ``stop`` in one process (as the tests call them): the SIGTERMed leader is
    our child, and left unreaped its zombie kept the group alive for both waits (60 s a stop)."""
    import os
    import subprocess

    from scripts.tsctl import stop_group

    leader = subprocess.Popen(["sleep", "30"], start_new_session=True)
    stop_group(leader.pid, timeout=2)
    with pytest.raises(ChildProcessError):
        os.waitpid(leader.pid, os.WNOHANG)
    with pytest.raises(ProcessLookupError):
        os.killpg(leader.pid, 0)
    leader.returncode = -15  # reaped above; Popen must not wait for it again


def test_a_load_failure_is_read_again_until_its_lines_stop_arriving():
    """The worker's error reaches the log a line at a time: its first line must not end the message."""
    log = iter(["Failed to load model\nreason:", "Failed to load model\nreason:\nthe compiler changed",
                "Failed to load model\nreason:\nthe compiler changed"])
    assert settled(lambda: next(log), "Failed to load model", interval=0.01) == (
        "Failed to load model\nreason:\nthe compiler changed")
    assert settled(lambda: "still growing" + str(time.monotonic()), "x", interval=0.01, limit=0.1).startswith(
        "still growing")


@pytest.mark.parametrize("name", ["ts_log", "model_log"])
def test_a_log_is_read_whole_across_the_files_log4j2_rolled_it_into(tmp_path, name):
    """A server started before midnight has its first lines in yesterday's file (log4j2.xml rolls by
    day), which the end-to-end tests and the bench must still read."""
    config = (ROOT / "log4j2.xml").read_text()
    pattern = re.search(rf'filePattern="\$\{{env:LOG_LOCATION:-logs\}}/({name}\.%d\{{dd-MMM\}}\.log\.gz)"', config)
    assert pattern, f"log4j2.xml no longer rolls {name} as read_log expects"
    logs = tmp_path / "logs"
    logs.mkdir()
    assert read_log(tmp_path, name) == ""
    for age, day in ((2, "05-Dec"), (1, "06-Dec")):
        rolled = logs / pattern.group(1).replace("%d{dd-MMM}", day)
        rolled.write_bytes(gzip.compress(f"{day} line\n".encode()))
        os.utime(rolled, (time.time() - age * 86400,) * 2)
    (logs / f"{name}.log").write_text("today's line\n")
    assert read_log(tmp_path, name) == "05-Dec line\n06-Dec line\ntoday's line\n"
