"""Test double of ``transformers_neuronx/ops.py`` (aws-neuron/transformers-neuronx): only ``init()``.

The real ``init()`` is ``torch.ops.neuron._init_neuron()``, which starts the Neuron runtime
and takes this process's NeuronCores; ``to_neuron()`` calls it first.  The double's runtime
is ``torch_neuronx/_fake_nrt.py`` (one owner per core, until the owner exits).
"""
from torch_neuronx import _fake_nrt


def init():
    """Claim the NeuronCores of this process; returns their indices (double only)."""
    return _fake_nrt.init()
