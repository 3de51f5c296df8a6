"""Double-only stand-in for the Neuron runtime (libnrt) that ``torch.ops.neuron._init_neuron()``
starts: which NeuronCores a process gets, and that it keeps them until it exits.

The real runtime gives each NeuronCore to one process. A second process that asks for a
core in use fails at ``nrt_init`` with ``NRT:nrt_allocate_neuron_cores ... Logical Neuron
Core(s) not available``. The cores come back only when the owning process exits; freeing
the model objects does not release them. So a build that loaded the model onto the cores
must exit before a TorchServe worker on the same host can load it.

The double keeps the claims in a registry directory shared by every process on the
"host": ``$FAKE_NEURON_CORE_REGISTRY``, default ``<temp dir>/fake-neuron-cores``. One file
per core, ``nc<index>``, holds the owner's PID and its start time (``/proc/<pid>/stat``),
so a claim of a process that has exited (or whose PID was reused) is stale and ignored.

Which cores a process asks for, as the real runtime reads it:

* ``NEURON_RT_VISIBLE_CORES`` (``"0-1"``, ``"2"``, ``"0,2-3"``): exactly those cores;
* else ``NEURON_RT_NUM_CORES=n``: the first ``n`` consecutive cores that are free;
* else every core of the host (``FAKE_NEURON_DEVICES`` x 2, as ``bin/neuron-ls`` reports).
"""
import contextlib
import fcntl
import os
import tempfile

CORES_PER_DEVICE = 2


def registry_dir():
    return os.environ.get("FAKE_NEURON_CORE_REGISTRY") or os.path.join(tempfile.gettempdir(), "fake-neuron-cores")


def host_cores():
    return int(os.environ.get("FAKE_NEURON_DEVICES", "1")) * CORES_PER_DEVICE


def parse_visible(spec):
    """Core indices of a ``NEURON_RT_VISIBLE_CORES`` value such as ``0-3`` or ``0,2``."""
    cores = []
    for part in spec.split(','):
        lo, _, hi = part.strip().partition('-')
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def _start_time(pid):
    """The process's start time in clock ticks (field 22 of /proc/<pid>/stat); None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else fields[19]


def _owner(path):
    """The live PID holding the core file at ``path``, or None if free or stale."""
    try:
        with open(path) as f:
            pid, started = f.read().split()
    except (OSError, ValueError):
        return None
    return int(pid) if _start_time(int(pid)) == started else None


@contextlib.contextmanager
def _locked(directory):
    """Serialise check-and-claim between processes (the runtime's driver does this in the kernel)."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _wanted(owners):
    """The cores this process asks for, given ``owners`` (core -> live PID of another process)."""
    total = len(owners)
    visible = os.environ.get("NEURON_RT_VISIBLE_CORES")
    if visible:
        cores = parse_visible(visible)
        if max(cores) >= total:
            raise RuntimeError(f"NRT: NEURON_RT_VISIBLE_CORES={visible} names NeuronCore {max(cores)}, "
                               f"but this host has {total} (nc0-nc{total - 1})")
        return cores, f"nc{cores[0]}-nc{cores[-1]}"
    count = int(os.environ.get("NEURON_RT_NUM_CORES") or total)
    for first in range(total - count + 1):
        if all(owners[c] is None for c in range(first, first + count)):
            return list(range(first, first + count)), str(count)
    return list(range(count)), str(count)


def init():
    """Claim this process's NeuronCores; ``RuntimeError`` if another live process holds one.

    Returns the claimed core indices. Calling it again from the same process is a no-op
    for cores it already holds, as the real runtime initialises once per process.
    """
    directory, me = registry_dir(), os.getpid()
    with _locked(directory):
        owners = {c: _owner(os.path.join(directory, f"nc{c}")) for c in range(host_cores())}
        owners = {c: (None if pid == me else pid) for c, pid in owners.items()}
        cores, requested = _wanted(owners)
        busy = {c: owners[c] for c in cores if owners[c] is not None}
        if busy:
            free = sum(pid is None for pid in owners.values())
            holders = ", ".join(f"nc{c} (pid {pid})" for c, pid in busy.items())
            raise RuntimeError(
                f"NRT:nrt_allocate_neuron_cores Logical Neuron Core(s) not available - Requested:{requested} "
                f"Available:{free}; held by another process: {holders}. A NeuronCore belongs to one process "
                "until that process exits: stop it, or give this process other cores (NEURON_RT_VISIBLE_CORES)")
        started = _start_time(me)
        for core in cores:
            with open(os.path.join(directory, f"nc{core}"), "w") as f:
                f.write(f"{me} {started}")
    return cores


def holders():
    """``{pid: [cores]}`` of the live owners in the registry (for ``neuron-ls``)."""
    directory, out = registry_dir(), {}
    for core in range(host_cores()):
        pid = _owner(os.path.join(directory, f"nc{core}"))
        if pid is not None:
            out.setdefault(pid, []).append(core)
    return out
