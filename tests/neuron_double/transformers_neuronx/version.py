"""Test double of ``transformers_neuronx/version.py`` (aws-neuron/transformers-neuronx).

The real file holds ``'0.13.x'`` in the source tree; released wheels carry the build
number, e.g. ``0.13.1322`` (Neuron SDK 2.21).
"""

__version__ = "0.13.1322"
