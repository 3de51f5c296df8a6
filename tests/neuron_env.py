"""Put the Neuron SDK test double (tests/neuron_double) in place for a test, then take it away.

In-process: the double's directory goes on sys.path and its modules are dropped from
sys.modules afterwards, so other tests still see a machine without the SDK. For a
TorchServe worker: ``subprocess_env`` gives the PYTHONPATH and PATH (for the fake neuron-ls).

Every environment gets a "host" of its own: a fresh NeuronCore registry
(``FAKE_NEURON_CORE_REGISTRY``, where the double records which process owns which core), so
that test processes running side by side, and the servers of one test run, do not take each
other's cores. Pass ``FAKE_NEURON_CORE_REGISTRY`` to put several processes on one host.
"""
from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import sys
import tempfile
from pathlib import Path

DOUBLE = Path(__file__).resolve().parent / "neuron_double"
SDK_MODULES = ("transformers_neuronx", "torch_neuronx", "neuronxcc")
RUNTIME_VARS = ("NEURON_RT_NUM_CORES", "NEURON_RT_VISIBLE_CORES", "NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL",
                "FAKE_NEURONXCC_VERSION", "FAKE_NEURON_DEVICES", "FAKE_NEURON_COMPILE_SECONDS",
                "FAKE_NEURON_CORE_REGISTRY")
_hosts = itertools.count()
_hosts_root: list = []


def new_host() -> str:
    """A fresh core registry: an inf2 host of its own, whose cores nobody holds yet."""
    if not _hosts_root:
        _hosts_root.append(tempfile.mkdtemp(prefix="fake-neuron-hosts-"))
        atexit.register(shutil.rmtree, _hosts_root[0], True)
    return os.path.join(_hosts_root[0], f"host-{next(_hosts)}")


def subprocess_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in RUNTIME_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(DOUBLE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(DOUBLE / "bin"), os.path.dirname(sys.executable), env.get("PATH", "")])
    env["FAKE_NEURON_CORE_REGISTRY"] = new_host()
    env.update({k: str(v) for k, v in extra.items()})
    return env


@contextlib.contextmanager
def neuron_double(**extra_env):
    saved_env = {k: os.environ.get(k) for k in (*RUNTIME_VARS, "PATH", "PYTHONPATH", *extra_env)}
    sys.path.insert(0, str(DOUBLE))
    os.environ.update(subprocess_env(**extra_env))
    for var in RUNTIME_VARS:
        if var not in extra_env and var != "FAKE_NEURON_CORE_REGISTRY":
            os.environ.pop(var, None)
    try:
        yield
    finally:
        sys.path.remove(str(DOUBLE))
        for name in list(sys.modules):
            if name.split(".")[0] in SDK_MODULES:
                del sys.modules[name]
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
