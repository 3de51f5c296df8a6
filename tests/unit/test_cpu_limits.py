"""The CPUs a worker may use (affinity, cgroup v1/v2 quotas) and the thread count taken from them.

The cgroup cases read a file tree laid out as a host or a container shows it; the affinity case
runs a real process under ``taskset``.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llama_engine import cpu_limits
from llama_engine.cpu_limits import UsableCpus, cgroup_cpu_quota, model_threads, usable_cpus

HANDLERS = Path(__file__).resolve().parents[2] / "handlers"
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = ("31 23 0:28 {root} /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
             "32 23 0:29 {root} /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n")


def fake_root(tmp_path: Path, mountinfo: str, membership: str, files: dict) -> Path:
    for relative, text in {"proc/self/mountinfo": mountinfo, "proc/self/cgroup": membership, **files}.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_cgroup_v2_takes_the_lowest_quota_of_the_cgroup_and_its_ancestors(tmp_path):
    root = fake_root(tmp_path, V2_MOUNT, "0::/kubepods/pod1/ctr\n", {
        "sys/fs/cgroup/kubepods/cpu.max": "400000 100000\n",
        "sys/fs/cgroup/kubepods/pod1/cpu.max": "150000 100000\n",
        "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root) == pytest.approx(1.5)


def test_cgroup_v2_without_a_quota_anywhere_is_no_limit(tmp_path):
    root = fake_root(tmp_path, V2_MOUNT, "0::/user.slice\n", {
        "sys/fs/cgroup/user.slice/cpu.max": "max 100000\n"})
    assert cgroup_cpu_quota(root) is None


def test_cgroup_v1_in_a_container_whose_mount_is_its_own_cgroup(tmp_path):
    root = fake_root(tmp_path, V1_MOUNTS.format(root="/docker/abc"), "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n", {
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
        "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "sys/fs/cgroup/memory/cpu.cfs_quota_us": "50000\n"})  # not the cpu controller's: ignored
    assert cgroup_cpu_quota(root) == pytest.approx(2.0)


def test_cgroup_v1_on_a_host_reads_below_the_mount_and_minus_one_is_no_limit(tmp_path):
    files = {"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
             "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
             "sys/fs/cgroup/cpu,cpuacct/batch/cpu.cfs_quota_us": "300000\n",
             "sys/fs/cgroup/cpu,cpuacct/batch/cpu.cfs_period_us": "100000\n"}
    root = fake_root(tmp_path, V1_MOUNTS.format(root="/"), "4:cpu,cpuacct:/batch\n", files)
    assert cgroup_cpu_quota(root) == pytest.approx(3.0)
    (root / "proc/self/cgroup").write_text("4:cpu,cpuacct:/\n")
    assert cgroup_cpu_quota(root) is None


def test_no_proc_files_is_no_limit(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None


@pytest.mark.parametrize("affinity, quota, expected", [
    (8, None, UsableCpus(8, "CPU affinity")),
    (8, 4.0, UsableCpus(4, "cgroup CPU quota 4")),
    (8, 2.5, UsableCpus(3, "cgroup CPU quota 2.5")),  # rounded up, as the JVM does
    (8, 0.5, UsableCpus(1, "cgroup CPU quota 0.5")),
    (2, 4.0, UsableCpus(2, "CPU affinity")),
])
def test_usable_cpus_is_the_affinity_capped_by_the_quota(monkeypatch, affinity, quota, expected):
    monkeypatch.setattr(cpu_limits.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(cpu_limits, "cgroup_cpu_quota", lambda root=None: quota)
    assert usable_cpus() == expected


def test_a_configured_count_above_the_usable_cpus_is_lowered_with_a_warning_naming_the_field(caplog, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with caplog.at_level(logging.INFO, logger=cpu_limits.logger.name):
        assert model_threads(4, UsableCpus(2, "CPU affinity")) == 2
        assert model_threads(1, UsableCpus(2, "CPU affinity")) == 1
        assert model_threads(None, UsableCpus(3, "cgroup CPU quota 2.5")) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "handler.torch_threads is 4" in warnings[0] and "computing with 2" in warnings[0]
    assert any("torch threads 3" in r.getMessage() and "cgroup CPU quota 2.5" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("env, configured, expected", [
    ("3", None, 3),       # the user's OpenMP count where the config leaves it
    ("8", None, 4),       # lowered to the usable CPUs like a config's
    ("3", 2, 2),          # the config's own count wins
    ("", None, 4), ("zero", None, 4), ("0", None, 4),  # not a count: the usable CPUs
])
def test_omp_num_threads_counts_where_torch_threads_is_unset(monkeypatch, caplog, env, configured, expected):
    monkeypatch.setenv("OMP_NUM_THREADS", env)
    with caplog.at_level(logging.INFO, logger=cpu_limits.logger.name):
        assert model_threads(configured, UsableCpus(4, "CPU affinity")) == expected
    if env == "8":
        assert any("OMP_NUM_THREADS is 8" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.skipif(not shutil.which("taskset") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs taskset and 2 CPUs to leave one out")
def test_the_handler_under_taskset_computes_with_the_one_cpu_it_is_given():
    """The real handler function in a real process pinned to one CPU: torch gets 1 thread whether
    torch_threads is unset or set to more."""
    code = ("import torch, llama_handler\n"
            "from types import SimpleNamespace as N\n"
            "for t in (None, 2):\n"
            "    print(llama_handler.set_torch_threads(N(handler=N(torch_threads=t))), torch.get_num_threads())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HANDLERS), os.environ.get("PYTHONPATH", "")])}
    env.pop("OMP_NUM_THREADS", None)
    cpu = sorted(os.sched_getaffinity(0))[0]
    out = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == ["1", "1", "1", "1"]


def test_a_mountinfo_this_parser_does_not_know_is_no_limit_not_a_failed_load(tmp_path):
    root = fake_root(tmp_path, "garbage - \n31 23 0:28 / /sys/fs/cgroup/cpu rw - cgroup\n", "4:cpu:/x\n", {})
    assert cgroup_cpu_quota(root) is None


@pytest.mark.parametrize("threads, env, says", [
    (2, {}, "OMP_WAIT_POLICY is not PASSIVE"),
    (2, {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "20000"}, "OMP_WAIT_POLICY is not PASSIVE"),
    (2, {"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE without GOMP_SPINCOUNT"),
    (2, {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": ""}, "PASSIVE without GOMP_SPINCOUNT"),
    (2, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}, None),
    (1, {}, None),  # one thread has no team to wait for
])
def test_the_handler_names_both_openmp_waits_that_serving_needs(threads, env, says):
    import llama_handler

    warning = llama_handler.openmp_wait_warning(threads, env)
    if says is None:
        assert warning is None
    else:
        assert says in warning and "OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=20000" in warning
