"""Test double of ``transformers_neuronx/config.py`` (aws-neuron/transformers-neuronx, 0.13.x).

``NeuronConfig``, ``ContinuousBatchingConfig`` and ``GenerationConfig`` take exactly the
real keyword arguments, with the real defaults, keyword-only markers and assertion
messages, so that a misspelt keyword fails here as it would on an inf2 host.
Quantization / sparse-attention configs are accepted as opaque objects.
"""
import enum
import os
import warnings
from typing import List, Optional

import torch

from transformers_neuronx.constants import GQA, Layout

valid_dtypes = ["float32", "float16", "bfloat16"]


def _pop_given(kwargs, key, default):
    """Pop ``key`` only when it holds a non-None value (the real parsing rule)."""
    return kwargs.pop(key) if kwargs.get(key) is not None else default


class ContinuousBatchingConfig:
    """Real signature: ``__init__(self, **kwargs)``; ``max_num_seqs`` (or its old name
    ``batch_size_for_shared_caches``) is required, anything unknown is an AssertionError."""

    def __init__(self, **kwargs):
        # Like the real code, a keyword given as None is *not* consumed, so it then
        # trips the final assertion; a missing max_num_seqs/batch_size_for_shared_caches
        # is a KeyError.
        if kwargs.get("max_num_seqs") is not None:
            self.max_num_seqs = kwargs.pop("max_num_seqs")
        else:
            self.max_num_seqs = kwargs.pop("batch_size_for_shared_caches")
        self.max_model_len = _pop_given(kwargs, "max_model_len", None)
        self.optimized_paged_attention = _pop_given(kwargs, "optimized_paged_attention", False)
        self.enable_chunked_prefill = _pop_given(kwargs, "enable_chunked_prefill", False)
        if self.enable_chunked_prefill:
            assert self.optimized_paged_attention, "chunked prefill is only supported with optimized paged attention"
        self.block_size = None
        self.num_blocks = None
        assert len(kwargs) == 0, f"unexpected key word arguments: {kwargs.keys()}"

    @property
    def batch_size_for_shared_caches(self) -> int:
        return self.max_num_seqs

    @property
    def _paged_attention(self) -> bool:
        return bool(self.block_size and self.max_model_len and self.block_size < self.max_model_len)

    def init_cache_engine(self, block_size, num_blocks):
        self.block_size = block_size
        self.num_blocks = num_blocks


class GenerationConfig:
    """On-device generation settings (real fields and defaults, keyword-only)."""

    def __init__(self, *,
                 max_length=None,
                 do_sample=False,
                 top_k=50,
                 top_p=1.0,
                 top_p_min_tokens=1,
                 global_top_k=None,
                 eos_token_id=None,
                 temperature=1.0,
                 dynamic=False,
                 deterministic=False,
                 per_batch_line=False,
                 ):
        self.max_length = max_length
        self.do_sample = do_sample
        self.per_batch_line = per_batch_line
        self.top_k = top_k
        self.top_p = [float(p) for p in top_p] if isinstance(top_p, list) else float(top_p)
        self.temperature = ([float(t) for t in temperature] if isinstance(temperature, list)
                            else float(temperature))
        self.top_p_min_tokens = top_p_min_tokens
        self.global_top_k = global_top_k
        self.eos_token_id = eos_token_id
        self.dynamic = dynamic
        self.deterministic = deterministic

    def __eq__(self, value: object) -> bool:
        return isinstance(value, GenerationConfig) and self.__dict__ == value.__dict__


class NeuronConfig:
    """Neuron feature switches.  Keyword-only; unknown keywords fail with the real
    ``AssertionError("Unexpected NeuronConfig keyword arguments: {...}")``."""

    def __init__(self, *,
                 sparse_attn=None,
                 quant=None,
                 kv_cache_quant=None,
                 continuous_batching: Optional[ContinuousBatchingConfig] = None,
                 attention_layout: Layout = Layout.HSB,
                 collectives_layout: Layout = Layout.HSB,
                 cache_layout: Layout = Layout.SBH,
                 padding_side: str = 'left',
                 group_query_attention: Optional[GQA] = None,
                 sequence_parallel_norm: bool = False,
                 sequence_parallel_norm_threshold: int = 2048,
                 bf16_rms_norm: bool = False,
                 on_device_embedding: bool = False,
                 on_device_generation: Optional[GenerationConfig] = None,
                 all_reduce_dtype: Optional[str] = None,
                 cast_logits_dtype: str = 'float32',
                 fuse_qkv: bool = False,
                 qkv_tiling: bool = False,
                 weight_tiling: bool = False,
                 mlp_in_weight_tiling_permute_order: List[int] = [1, 2, 0, 3],
                 mlp_out_weight_tiling_permute_order: List[int] = [1, 2, 0, 3],
                 log_softmax_scores: bool = False,
                 shard_over_sequence: bool = False,
                 output_all_logits: bool = False,
                 attn_output_transposed: bool = False,
                 fused_rmsnorm_qkv: bool = False,
                 fused_rmsnorm_mlp: bool = False,
                 mlp_out_weight_transpose: bool = False,
                 fuse_mlp: bool = False,
                 is_eagle_target: bool = False,
                 is_eagle_draft: bool = False,
                 has_pre_attention_norm: bool = True,
                 compilation_worker_count: Optional[int] = None,
                 duplicate_q_weight_sos: bool = False,
                 **kwargs,
                 ):
        self.all_reduce_dtype = all_reduce_dtype
        self.sparse_attn = sparse_attn
        self.quant = quant
        self.kv_cache_quant = kv_cache_quant
        assert cast_logits_dtype in valid_dtypes, (
            f"The `cast_logits_dtype={cast_logits_dtype}` argument must be one of {valid_dtypes}")
        self.cast_logits_dtype = cast_logits_dtype
        self.fuse_qkv = fuse_qkv
        self.fuse_mlp = fuse_mlp
        self.continuous_batching = continuous_batching
        assert padding_side in ['left', 'right'], (
            f"The `padding_side={padding_side}` argument must be either 'left' or 'right'")
        self.padding_side = padding_side
        self.lhs_aligned = padding_side == 'right'
        for old in ('use_2d_cache_ids', 'lhs_aligned'):
            if old in kwargs:
                warnings.warn(f"NeuronConfig `{old}` argument is deprecated. "
                              "Please specify `padding_side = 'right'`.")
                self.lhs_aligned = kwargs.pop(old, False)
        if self.continuous_batching:
            # Continuous batching forces right padding (real behaviour).
            self.lhs_aligned = True
            self.padding_side = "right"
        self.attention_layout = attention_layout
        self.collectives_layout = collectives_layout
        self.cache_layout = cache_layout
        self.log_softmax_scores = log_softmax_scores
        self.group_query_attention = None if group_query_attention is None else GQA(group_query_attention)
        assert sequence_parallel_norm_threshold > 0, (
            f"sequence_parallel_norm_threshold={sequence_parallel_norm_threshold} must be greater than zero")
        self.sequence_parallel_norm = sequence_parallel_norm
        self.sequence_parallel_norm_threshold = sequence_parallel_norm_threshold
        self.bf16_rms_norm = bf16_rms_norm
        self.on_device_embedding = on_device_embedding
        self.on_device_generation = on_device_generation
        if qkv_tiling is True:
            assert fuse_qkv is True, "QKV weight tiling is currently only supported when QKV fusion is enabled."
        self.qkv_tiling = qkv_tiling
        self.weight_tiling = weight_tiling
        self.mlp_in_weight_tiling_permute_order = mlp_in_weight_tiling_permute_order
        self.mlp_out_weight_tiling_permute_order = mlp_out_weight_tiling_permute_order
        for order in (mlp_in_weight_tiling_permute_order, mlp_out_weight_tiling_permute_order):
            assert order.index(2) < order.index(3), "original dim 2 has to be front of dim 3 after applying the permute order"
        self.output_all_logits = output_all_logits

        assert len(kwargs) == 0, f"Unexpected NeuronConfig keyword arguments: {kwargs}"

        self.rank_id = int(os.getenv("NEURON_RANK_ID", "0"))
        local_tp = os.getenv("NEURON_LOCAL_TP", None)
        self.local_tp = int(local_tp) if local_tp is not None else None
        self.pp_stages = int(os.getenv("NEURON_PP_STAGES", 1))
        self.dist = None
        self.layer_partition = {}
        self.shard_over_sequence = shard_over_sequence
        self.is_sequence_parallel = False
        self.attn_output_transposed = attn_output_transposed
        self.fused_rmsnorm_qkv = fused_rmsnorm_qkv
        self.fused_rmsnorm_mlp = fused_rmsnorm_mlp
        if (not self.fuse_qkv or self.attention_layout != Layout.BSH
                or self.group_query_attention != GQA.REPLICATED_HEADS or self.sequence_parallel_norm):
            self.fused_rmsnorm_qkv = False
        if self.attention_layout != Layout.BSH or self.group_query_attention != GQA.REPLICATED_HEADS:
            self.fused_rmsnorm_mlp = False
        self.mlp_out_weight_transpose = mlp_out_weight_transpose
        if self.shard_over_sequence:
            assert self.sparse_attn is None, "sparse attn is not supported with flash decoding"
            if not (self.continuous_batching and self.continuous_batching.optimized_paged_attention):
                assert self.cache_layout == Layout.SBH, f"flash decoding only support SBH layout , got {self.cache_layout}"
        self.duplicate_q_weight_sos = duplicate_q_weight_sos
        self.is_eagle_target = is_eagle_target
        self.is_eagle_draft = is_eagle_draft
        self.has_pre_attention_norm = has_pre_attention_norm
        self.compilation_worker_count = compilation_worker_count

    @property
    def use_2d_cache_ids(self):
        return self.lhs_aligned

    @property
    def use_1d_query(self):
        return self.cache_layout == Layout.BSH and self.padding_side == 'right'

    @property
    def bsh_cache_layout(self):
        return self.cache_layout == Layout.BSH

    @property
    def paged_attention(self):
        if self.continuous_batching:
            return self.continuous_batching._paged_attention and self.bsh_cache_layout
        return False

    @property
    def enable_chunked_prefill(self):
        return self.paged_attention and self.continuous_batching.enable_chunked_prefill

    @property
    def optimized_paged_attention(self):
        return self.paged_attention and self.continuous_batching.optimized_paged_attention

    @property
    def vectorize_last_token_id(self):
        return self.lhs_aligned

    def is_pp(self):
        return self.pp_stages > 1

    def auto_layer_partition(self, num_layers):
        """Layers this rank holds; pipeline parallelism is not emulated, so all of them."""
        self.num_layers = num_layers
        return list(range(num_layers))

    def to_json(self):
        """JSON-able view of the config (same conversion rules as the real ``to_json``)."""
        def _to_json(obj):
            if obj is None or isinstance(obj, (str, int, float, bool)):
                return obj
            if isinstance(obj, enum.Enum):
                return obj.value
            if isinstance(obj, torch.Tensor):
                return obj.tolist()
            if isinstance(obj, list):
                return [_to_json(e) for e in obj]
            if isinstance(obj, dict):
                return {_to_json(k): _to_json(v) for k, v in obj.items()}
            if isinstance(obj, tuple):
                return str(tuple(_to_json(e) for e in obj))
            return _to_json(obj.__dict__)
        return _to_json(self)
