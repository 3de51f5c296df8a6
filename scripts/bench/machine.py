"""What the figures were measured on: CPU, memory, OS, and the versions of everything involved."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Optional

from llama_engine import cpu as cpu_features
from llama_engine.cpu_limits import usable_cpus

ROOT = Path(__file__).resolve().parents[2]


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, with its family and model numbers where the name alone is vague.

    A VM's name can be as bare as "AMD EPYC", which covers a Zen 4 and a Zen 5 whose bf16
    matrix products differ twofold; the numbers tell them apart (family 25 is Zen 3/4, 26 Zen 5).
    """
    fields = {}
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
            if not line.strip():
                break  # the first CPU's block says it all
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def emulate(target: str) -> dict:
    """Have this process, and every server it starts, compute as a CPU of class ``target`` would
    (``llama_engine.cpu.emulation_env``); the variables it set. Raises where torch had already
    chosen its kernels, or this CPU cannot run the class's instructions."""
    env = cpu_features.emulation_env(target)
    os.environ.update(env)
    import torch

    want, got = env.get("ATEN_CPU_CAPABILITY"), torch.backends.cpu.get_cpu_capability()
    if want and got.lower() != want.lower():
        raise RuntimeError(f"--cpu-class {target}: torch computes with {got} here, not {want}; ATEN_CPU_CAPABILITY "
                           f"must be set before this process first uses torch (run the bench afresh)")
    return env


def openmp_as_served() -> dict:
    """Have this process's OpenMP threads wait as a server's do (``scripts.tsctl``'s
    ``OMP_WAIT_POLICY`` and ``GOMP_SPINCOUNT``, unless set already), so that the in-process rows,
    the bounds and the kernels' comparisons face what a served worker faces rather than threads
    that spin ~3 ms after every torch op and take the native kernels' cores. libgomp reads them
    when torch loads it: returns what was set, or raises where that already happened."""
    from scripts.tsctl import GOMP_SPINCOUNT, OMP_WAIT_POLICY

    wanted = {"OMP_WAIT_POLICY": OMP_WAIT_POLICY, "GOMP_SPINCOUNT": GOMP_SPINCOUNT}
    if "torch" in sys.modules:
        if all(os.environ.get(k) == v for k, v in wanted.items()):
            return wanted  # set before this process started: already in effect
        raise RuntimeError("the bench sets OMP_WAIT_POLICY and GOMP_SPINCOUNT before torch loads, but torch is "
                           "loaded already; run `python -m scripts.bench` afresh")
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in wanted}


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> Optional[int]:
    """The size of the first CPU's last-level cache (sysfs ``indexN/size`` at the highest ``level``),
    None where sysfs does not say. A bench model whose weights fit it decodes partly from the cache."""
    caches = []
    for index in sorted(root.glob("index*")):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        number, unit = (size[:-1], _SIZE_UNITS[size[-1]]) if size[-1:] in _SIZE_UNITS else (size, 1)
        if number.isdigit():
            caches.append((level, int(number) * unit))
    return max(caches)[1] if caches else None


def machine_info() -> dict:
    flags, host_class = cpu_features.cpu_flags(), cpu_features.cpu_class(cpu_features.host_cpu_flags())
    info = {"cpu": _cpu_model(), "logical_cpus": os.cpu_count(), "cpu_flags": cpu_features.reported_flags(flags),
            "cpu_class": cpu_features.cpu_class(flags), "auto_dtype": cpu_features.auto_dtype("cpu", flags),
            "platform": platform.platform()}
    info["last_level_cache_bytes"] = last_level_cache_bytes()
    info["openmp_env"] = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    usable = usable_cpus()  # what the served worker's threads default to (a container's share of the host)
    info["usable_cpus"], info["usable_cpus_source"] = usable.count, usable.source
    if info["cpu_class"] != host_class:
        info["emulated_on"] = host_class
        info["emulation_env"] = {k: os.environ[k] for k in cpu_features.EMULATION_VARS if k in os.environ}
    try:
        import psutil

        info["memory_gb"] = round(psutil.virtual_memory().total / 1e9, 1)
        info["physical_cores"] = psutil.cpu_count(logical=False)
    except ImportError:
        pass
    try:
        import torch

        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        info["cuda"] = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        pass
    try:
        hv = subprocess.run(["systemd-detect-virt"], capture_output=True, text=True, timeout=5).stdout.strip()
        if hv:
            info["virtualization"] = hv
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "tokenizers", "safetensors", "torchserve", "torch-model-archiver",
                 "numpy", "requests", "matplotlib"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=20)
        out["java"] = (java.stderr or java.stdout).splitlines()[0] if (java.stderr or java.stdout) else None
    except (OSError, subprocess.SubprocessError):
        out["java"] = None
    try:
        git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=20)
        out["git"] = git.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


class CpuMonitor:
    """CPU time the rest of the machine used while we measured: other people's work skews every figure.

    ``foreign_cpu_share`` = (busy CPU seconds of the whole machine - CPU seconds of this process
    and its children, servers included) / (wall seconds x logical CPUs); ``steal_share`` is the
    hypervisor's steal time on the same scale.
    """

    def __init__(self):
        import psutil

        self.psutil = psutil
        self.me = psutil.Process()
        self.ncpu = psutil.cpu_count() or 1

    def _label(self, proc) -> str:
        if proc.pid == self.me.pid:
            return "bench (client threads or in-process engine)"
        try:
            cmd = " ".join(proc.cmdline())
            name = proc.name()
        except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
            return "other child"
        if "model_service_worker" in cmd:
            return "torchserve worker (python)"
        if name == "java":
            return "torchserve frontend (java)"
        return name

    def _ours(self) -> dict:
        """CPU seconds of this process and each of its descendants, by pid."""
        out = {}
        for proc in [self.me] + self.me.children(recursive=True):
            try:
                t = proc.cpu_times()
                out[proc.pid] = (self._label(proc), t.user + t.system)
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                pass
        return out

    def snapshot(self):
        t = self.psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        busy = sum(t) - idle - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        steal = getattr(t, "steal", 0.0)
        return time.monotonic(), busy - steal, steal, self._ours()

    def since(self, snap) -> dict:
        now = self.snapshot()
        wall = max(1e-9, now[0] - snap[0])
        by_label: dict = {}
        for pid, (label, cpu) in now[3].items():
            by_label[label] = by_label.get(label, 0.0) + cpu - snap[3].get(pid, (label, 0.0))[1]
        ours = sum(by_label.values())
        foreign = max(0.0, (now[1] - snap[1]) - ours)
        scale = wall * self.ncpu
        return {"foreign_cpu_share": round(foreign / scale, 3),
                "steal_share": round((now[2] - snap[2]) / scale, 3),
                "own_cpu_share": round(ours / scale, 3),
                "own_cpu_by_process": {k: round(v / scale, 3) for k, v in sorted(by_label.items()) if v > 0}}

    budget = float("inf")  # seconds of waiting left for the whole run

    def wait_quiet(self, max_wait: float, threshold: float = 0.10, window: float = 1.0) -> dict:
        """Wait (up to ``max_wait`` s, and what is left of ``budget``) for a ``window`` in which other
        processes use < ``threshold`` of the CPUs."""
        started = time.monotonic()
        max_wait = max(0.0, min(max_wait, self.budget))
        share = None
        while True:
            snap = self.snapshot()
            time.sleep(window)
            share = self.since(snap)["foreign_cpu_share"]
            if share < threshold or time.monotonic() - started >= max_wait:
                self.budget -= time.monotonic() - started
                return {"waited_s": round(time.monotonic() - started, 1), "foreign_cpu_share_before": share,
                        "quiet": share < threshold}
