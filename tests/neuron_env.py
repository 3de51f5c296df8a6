"""Put the Neuron SDK test double (tests/neuron_double) in place for a test, then take it away.

In-process: the double's directory goes on sys.path and its modules are dropped from
sys.modules afterwards, so other tests still see a machine without the SDK. For a
TorchServe worker: ``subprocess_env`` gives the PYTHONPATH and PATH (for the fake neuron-ls).
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

DOUBLE = Path(__file__).resolve().parent / "neuron_double"
SDK_MODULES = ("transformers_neuronx", "torch_neuronx", "neuronxcc")
RUNTIME_VARS = ("NEURON_RT_NUM_CORES", "NEURON_RT_VISIBLE_CORES", "NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL",
                "FAKE_NEURONXCC_VERSION", "FAKE_NEURON_DEVICES", "FAKE_NEURON_COMPILE_SECONDS")


def subprocess_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in RUNTIME_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(DOUBLE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PATH"] = os.pathsep.join([str(DOUBLE / "bin"), os.path.dirname(sys.executable), env.get("PATH", "")])
    env.update({k: str(v) for k, v in extra.items()})
    return env


@contextlib.contextmanager
def neuron_double(**extra_env):
    saved_env = {k: os.environ.get(k) for k in (*RUNTIME_VARS, "PATH", "PYTHONPATH", *extra_env)}
    sys.path.insert(0, str(DOUBLE))
    os.environ.update(subprocess_env(**extra_env))
    for var in RUNTIME_VARS:
        if var not in extra_env:
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
