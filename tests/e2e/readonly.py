"""A read-only view of a directory, as SageMaker mounts /opt/ml/model.

Tests run as root here, and root ignores permission bits, so the view is a read-only bind
mount where the kernel allows one. Either way, a snapshot of the tree (names, sizes, mtimes)
taken before and compared after catches any write into it.
"""
from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from pathlib import Path


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if not p.is_symlink()}


@contextlib.contextmanager
def read_only_view(source: Path, mount_point: Path):
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = False
    if os.geteuid() == 0:
        bind = subprocess.run(["mount", "--bind", str(source), str(mount_point)], capture_output=True)
        if bind.returncode == 0:
            mounted = subprocess.run(["mount", "-o", "remount,ro,bind", str(mount_point)],
                                     capture_output=True).returncode == 0
            if not mounted:
                subprocess.run(["umount", str(mount_point)], capture_output=True)
    if not mounted:
        mount_point.rmdir()
        mount_point.symlink_to(source, target_is_directory=True)
        for p in [source, *source.rglob("*")]:
            os.chmod(p, os.stat(p).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        yield mount_point, mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(mount_point)], capture_output=True)


@contextlib.contextmanager
def guarded_read_only_view(source: Path, mount_point: Path, what: str = "something"):
    """``read_only_view``, and afterwards a check that nothing in ``source`` changed."""
    before = snapshot(source)
    with read_only_view(source, mount_point) as view:
        yield view
    assert snapshot(source) == before, f"{what} wrote into the model directory"
