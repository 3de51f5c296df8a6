"""Test double of the ``transformers_neuronx/llama`` package (aws-neuron/transformers-neuronx)."""
