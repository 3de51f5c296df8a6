"""Test double of the ``neuronxcc`` package (the Neuron compiler, neuronx-cc).

Only ``neuronxcc.__version__`` is provided: the real
``transformers_neuronx/compiler.py`` imports it to name the persistent-cache
folder ``neuronxcc-<version>``.  The version is read from the environment on
every access (``FAKE_NEURONXCC_VERSION``, default ``2.16.345.0``, the neuronx-cc of
Neuron SDK 2.21.0 pinned in requirements-neuron.txt) so that a test can emulate an
SDK upgrade without re-importing anything.

The real ``__version__`` carries a local build tag (SDK 2.20's neuronx-cc 2.15.128.0 reports
``2.15.128.0+56dc5a86``), so on a real host the cache folder is
``neuronxcc-2.16.345.0+<tag>``.  The tag of 2.16.345.0 is not known here, so the double
reports the bare version; nothing in the project depends on the tag (the manifest compares
``__version__`` at build and at load on the same kind of host).
"""
import os

DEFAULT_VERSION = "2.16.345.0"


def __getattr__(name):
    """PEP 562 hook: ``neuronxcc.__version__`` follows ``FAKE_NEURONXCC_VERSION`` live."""
    if name == "__version__":
        return os.environ.get("FAKE_NEURONXCC_VERSION") or DEFAULT_VERSION
    raise AttributeError(f"module 'neuronxcc' has no attribute {name!r}")
