"""Test double of ``transformers_neuronx/constants.py`` (aws-neuron/transformers-neuronx).

Same names and string values as the real module; the enums are what
``NeuronConfig`` accepts for ``attention_layout``/``cache_layout`` and
``group_query_attention``.
"""
import enum

TILE_SIZE = 128
FUSED_QKV_TP_FACTOR = 3
KV_SHARD_PAD = 128
TRN1_WORLD_SIZE = 32

LAYOUT_BSH = 'BSH'
LAYOUT_HSB = 'HSB'
LAYOUT_SBH = 'SBH'


class Layout(enum.Enum):
    """Tensor layouts.  Like the real enum, a member compares equal to its string value."""
    HSB = 'HSB'
    BSH = 'BSH'
    SBH = 'SBH'

    def __eq__(self, value):
        return super().__eq__(Layout(value))


class GQA(enum.Enum):
    """Grouped-query-attention sharding strategies (real string values)."""
    SHARD_OVER_HEADS = 'shard-over-heads'
    SHARD_OVER_BATCH = 'shard-over-batch'
    REPLICATED_HEADS = 'replicated-heads'
    ALL_GATHER_HEADS = 'all-gather-heads'
