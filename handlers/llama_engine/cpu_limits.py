"""How many CPUs this process may really use: the default for ``handler.torch_threads``.

``os.cpu_count()`` counts the host's CPUs, not the ones a container or ``taskset`` leaves the
worker. A model that starts a thread per host CPU on a 4-CPU cpuset of a 64-CPU host runs 16
lockstep threads per core, and every step waits for the ones the scheduler has parked. Measured
on the bench model (2-vCPU Zen 3 EPYC, in-process, 3 runs each): 8 threads on 2 CPUs took
12.1-14.5 ms a one-row decode step and 584-647 ms a 256-token prefill, where 2 threads took
10.2-11.2 and 443-472; on 1 CPU (``taskset -c 0``), 2 threads took 18.7-20.0 and 936-947, 1
thread 15.7-18.9 and 770-866.

Two limits count, whichever is lower: the CPU affinity (a container's cpuset, ``taskset``) and
the cgroup's CPU bandwidth quota (``docker --cpus``, a Kubernetes CPU limit), rounded up to
whole CPUs as the JVM and Go runtimes do.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Tuple

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UsableCpus:
    """The count and what set it, for the log line that reports the threads chosen."""

    count: int
    source: str


def usable_cpus(root: Path = Path("/")) -> UsableCpus:
    """The CPUs this process may use: its affinity, capped by its cgroup's CPU quota (``root``: the
    file system's root, where ``proc/self`` and the cgroup mounts are read)."""
    affinity = _affinity()
    quota = cgroup_cpu_quota(root)
    if quota is not None and math.ceil(quota) < affinity:
        return UsableCpus(max(1, math.ceil(quota)), f"cgroup CPU quota {quota:g}")
    return UsableCpus(affinity, "CPU affinity")


def model_threads(configured: Optional[int], usable: Optional[UsableCpus] = None) -> int:
    """The threads a model computes with: ``handler.torch_threads`` (``configured``), else
    ``OMP_NUM_THREADS``, at most the CPUs this process may use; those CPUs where neither is set.
    A count above them (a config written for a larger machine) is lowered, and the log says so
    (the module's figures)."""
    usable = usable or usable_cpus()
    name = "handler.torch_threads"
    if not configured:
        configured, name = _omp_num_threads(), "OMP_NUM_THREADS"
    if not configured:
        logger.info("torch threads %d: the CPUs this worker may use (%s; the host has %s)", usable.count,
                    usable.source, os.cpu_count())
        return usable.count
    if configured > usable.count:
        logger.warning("%s is %d but this worker may use %d CPU(s) (%s): computing with %d; lower %s or leave it "
                       "unset", name, configured, usable.count, usable.source, usable.count, name)
        return usable.count
    if name == "OMP_NUM_THREADS":
        logger.info("torch threads %d: OMP_NUM_THREADS (handler.torch_threads unset)", configured)
    return configured


def _omp_num_threads() -> Optional[int]:
    """``OMP_NUM_THREADS`` where it is one positive count (TorchServe's performance guide has users
    set it; torch itself honours it), else None."""
    try:
        value = int(os.environ.get("OMP_NUM_THREADS", "").strip())
    except ValueError:
        return None
    return value if value >= 1 else None


def _affinity() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cgroup_cpu_quota(root: Path = Path("/")) -> Optional[float]:
    """The CPUs' worth of time per period that this process's cgroup and its ancestors allow (the
    lowest of them), or None where none sets a quota or the files cannot be read."""
    try:
        mountinfo = (root / "proc/self/mountinfo").read_text()
        membership = (root / "proc/self/cgroup").read_text()
    except OSError:
        return None
    try:
        quotas = [q for chain, read in _cpu_cgroup_dirs(mountinfo, membership, root)
                  for q in map(read, chain) if q is not None]
    except (ValueError, IndexError, OSError):  # a layout this parser does not know: no limit rather than no worker
        logger.warning("could not read this process's cgroup CPU quota; counting its CPU affinity only", exc_info=True)
        return None
    return min(quotas) if quotas else None


def _cpu_cgroup_dirs(mountinfo: str, membership: str,
                     root: Path) -> Iterator[Tuple[List[Path], Callable[[Path], Optional[float]]]]:
    """For each cgroup mount that carries the cpu controller: this process's cgroup directory and
    its ancestors up to the mount, with the reader of that version's quota file."""
    paths = _membership(membership)
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        described = line.split(" - ", 1)[1].split()  # fstype, source, super options
        fstype = described[0] if described else ""
        controllers = described[-1].split(",") if len(described) > 2 else []
        mount_root, mount_point = fields[3], fields[4]
        if fstype == "cgroup2" and "" in paths:
            path = paths[""]
            reader = _read_cpu_max
        elif fstype == "cgroup" and "cpu" in controllers and "cpu" in paths:
            path = paths["cpu"]
            reader = _read_cfs_quota
        else:
            continue
        base = root / mount_point.lstrip("/")
        leaf = base / _below(path, mount_root)
        chain = [leaf] + [p for p in leaf.parents if p.is_relative_to(base)]
        yield chain, reader


def _below(path: str, mount_root: str) -> str:
    """``path`` relative to the mount's root; "" where the mount is the process's own cgroup (a
    cgroup namespace, a container's bind mount)."""
    if mount_root == "/":
        return path.lstrip("/")
    if path == mount_root or path.startswith(mount_root.rstrip("/") + "/"):
        return path[len(mount_root):].lstrip("/")
    return ""


def _membership(text: str) -> dict:
    """``/proc/self/cgroup``: the cgroup path by controller (``""`` for the cgroup v2 hierarchy)."""
    paths = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        for controller in parts[1].split(",") if parts[1] else [""]:
            paths[controller] = parts[2]
    return paths


def _read_cpu_max(directory: Path) -> Optional[float]:
    """cgroup v2 ``cpu.max``: ``max 100000`` (no limit) or ``QUOTA PERIOD`` in microseconds."""
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _read_cfs_quota(directory: Path) -> Optional[float]:
    """cgroup v1 ``cpu.cfs_quota_us`` (-1: no limit) over ``cpu.cfs_period_us``."""
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
