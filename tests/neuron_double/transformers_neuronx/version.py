"""Test double of ``transformers_neuronx/version.py`` (aws-neuron/transformers-neuronx).

The real file holds ``'0.13.x'`` in the source tree; released wheels carry the build
number: ``0.13.322`` is the one of Neuron SDK 2.21.0 (pinned in requirements-neuron.txt).
"""

__version__ = "0.13.322"
