"""The bench process computes under the OpenMP waits a served worker gets (scripts.tsctl)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(base, **env), capture_output=True,
                          text=True, timeout=120)


def test_libgomp_reads_the_served_waits_when_torch_loads_after_them():
    proc = _python("from scripts.bench import machine; print(machine.openmp_as_served()); "
                   "import torch; torch.ones(512, 512).sum()", OMP_DISPLAY_ENV="VERBOSE")
    assert proc.returncode == 0, proc.stderr
    assert "'OMP_WAIT_POLICY': 'PASSIVE', 'GOMP_SPINCOUNT': '20000'" in proc.stdout
    # libgomp prints the values it runs with as it loads
    assert "OMP_WAIT_POLICY = 'PASSIVE'" in proc.stderr and "GOMP_SPINCOUNT = '20000'" in proc.stderr


def test_a_wait_policy_set_already_is_kept():
    proc = _python("from scripts.bench import machine; print(machine.openmp_as_served())", OMP_WAIT_POLICY="ACTIVE")
    assert proc.returncode == 0, proc.stderr
    assert "'OMP_WAIT_POLICY': 'ACTIVE', 'GOMP_SPINCOUNT': '20000'" in proc.stdout


def test_too_late_once_torch_is_loaded_unless_the_environment_already_had_them():
    late = _python("import torch; from scripts.bench import machine; machine.openmp_as_served()")
    assert late.returncode != 0 and "run `python -m scripts.bench` afresh" in late.stderr
    preset = _python("import torch; from scripts.bench import machine; print(machine.openmp_as_served())",
                     OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT="20000")
    assert preset.returncode == 0 and "'GOMP_SPINCOUNT': '20000'" in preset.stdout, preset.stderr


def test_the_last_level_cache_is_the_highest_level_sysfs_lists(tmp_path):
    from scripts.bench import machine

    for index, level, size in (("index0", "1", "48K"), ("index2", "2", "2048K"), ("index3", "3", "266240K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "level").write_text(level + "\n")
        (tmp_path / index / "size").write_text(size + "\n")
    (tmp_path / "index1").mkdir()  # a cache sysfs does not describe is skipped
    assert machine.last_level_cache_bytes(tmp_path) == 266240 * 1024
    assert machine.last_level_cache_bytes(tmp_path / "missing") is None
