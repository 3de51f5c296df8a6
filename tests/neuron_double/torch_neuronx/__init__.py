"""Test double of the ``torch_neuronx`` package (torch-neuronx, the PyTorch Neuron plugin).

Only ``__version__`` is provided (real value format: ``<torch version>.<plugin version>``,
here the torch-neuronx 2.1.2.2.3.2 wheel that ships with Neuron SDK 2.20/2.21), so that
code which merely records the installed SDK versions can run without the SDK.
"""

__version__ = "2.1.2.2.3.2"
