"""Test double of the ``neuronxcc`` package (the Neuron compiler, neuronx-cc).

Only ``neuronxcc.__version__`` is provided: the real
``transformers_neuronx/compiler.py`` imports it to name the persistent-cache
folder ``neuronxcc-<version>``.  The version is read from the environment on
every access (``FAKE_NEURONXCC_VERSION``, default ``2.15.143.0``) so that a test
can emulate an SDK upgrade without re-importing anything.
"""
import os

DEFAULT_VERSION = "2.15.143.0"


def __getattr__(name):
    """PEP 562 hook: ``neuronxcc.__version__`` follows ``FAKE_NEURONXCC_VERSION`` live."""
    if name == "__version__":
        return os.environ.get("FAKE_NEURONXCC_VERSION") or DEFAULT_VERSION
    raise AttributeError(f"module 'neuronxcc' has no attribute {name!r}")
