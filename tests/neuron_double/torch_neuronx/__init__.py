"""Test double of the ``torch_neuronx`` package (torch-neuronx, the PyTorch Neuron plugin).

Only ``__version__`` is provided (real value format: ``<torch version>.<plugin version>``,
here torch-neuronx 2.5.1.2.4.0 of Neuron SDK 2.21.0, as pinned in requirements-neuron.txt),
so that code which merely records the installed SDK versions can run without the SDK.
``_fake_nrt`` stands in for the Neuron runtime that the real plugin starts.
"""

__version__ = "2.5.1.2.4.0"
