"""Tests of the Neuron SDK test double in tests/neuron_double (transformers_neuronx & co).

The double must fail where the real SDK fails (keywords, batch sizes, sampling
arguments, cache positions, missing artifacts), compute what HF transformers computes,
and reproduce the Neuron persistent compile cache layout and hit/miss behaviour.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

DOUBLE = Path(__file__).resolve().parents[1] / "neuron_double"
ROOT = DOUBLE.parents[1]
DOUBLE_PACKAGES = ("transformers_neuronx", "neuronxcc", "torch_neuronx")


@pytest.fixture(scope="module", autouse=True)
def tnx():
    """The double's ``transformers_neuronx``, importable only while this module's tests run
    (so that other test modules still see a machine without the Neuron SDK)."""
    before, added = set(sys.modules), str(DOUBLE) not in sys.path
    if added:
        sys.path.insert(0, str(DOUBLE))
    try:
        import transformers_neuronx
        yield transformers_neuronx
    finally:
        if added:
            sys.path.remove(str(DOUBLE))
        for name in set(sys.modules) - before:
            if name.split(".")[0] in DOUBLE_PACKAGES:
                del sys.modules[name]


ENV_VARS = ("NEURON_COMPILE_CACHE_URL", "NEURON_CC_FLAGS", "FAKE_NEURONXCC_VERSION", "FAKE_NEURON_COMPILE_SECONDS",
            "NEURON_RT_NUM_CORES", "NEURON_RT_VISIBLE_CORES", "FAKE_NEURON_DEVICES", "FAKE_NEURON_INSTANCE_TYPE",
            "FAKE_NEURON_CORE_REGISTRY")
SMALL = dict(batch_size=[1, 2], n_positions=128, context_length_estimate=[16, 32])
PROMPTS = ["The quick brown fox jumps over the lazy dog and", "Python"]


def _clean_env(mp, cache_dir):
    """No Neuron env vars, an empty persistent cache, and a core registry of its own (a host nobody else uses)."""
    for var in ENV_VARS:
        mp.delenv(var, raising=False)
    mp.setenv("NEURON_COMPILE_CACHE_URL", str(cache_dir))
    mp.setenv("FAKE_NEURON_CORE_REGISTRY", str(cache_dir.parent / "cores"))


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    """Every test starts with no Neuron env vars and an empty persistent cache."""
    path = tmp_path / "neuron-cache"
    _clean_env(monkeypatch, path)
    return path


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, use_safetensors=True, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def compiled(tnx, tiny_model_dir, tmp_path_factory):
    """A compiled double with batch sizes 1 and 2 (reset before each use)."""
    with pytest.MonkeyPatch.context() as mp:
        _clean_env(mp, tmp_path_factory.mktemp("shared-cache"))
        model = tnx.LlamaForSampling.from_pretrained(tiny_model_dir, **SMALL)
        model.to_neuron()
    return model


@pytest.fixture
def left_padded(tokenizer):
    """The two prompts left-padded, and each row's first real token (start_ids)."""
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"  # the tokenizer fixture is shared: restore it below
    try:
        enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    return enc.input_ids, enc.attention_mask.argmax(dim=1)


def _build(tnx, path, **kwargs):
    model = tnx.LlamaForSampling.from_pretrained(path, **{**SMALL, **kwargs})
    model.to_neuron()
    return model


def _stats(tnx):
    return dict(tnx.compiler_stats)


# ---- 1. configs ---------------------------------------------------------------------

REAL_NEURON_CONFIG_KEYWORDS = [
    "sparse_attn", "quant", "kv_cache_quant", "continuous_batching", "attention_layout", "collectives_layout",
    "cache_layout", "padding_side", "group_query_attention", "sequence_parallel_norm",
    "sequence_parallel_norm_threshold", "bf16_rms_norm", "on_device_embedding", "on_device_generation",
    "all_reduce_dtype", "cast_logits_dtype", "fuse_qkv", "qkv_tiling", "weight_tiling",
    "mlp_in_weight_tiling_permute_order", "mlp_out_weight_tiling_permute_order", "log_softmax_scores",
    "shard_over_sequence", "output_all_logits", "attn_output_transposed", "fused_rmsnorm_qkv",
    "fused_rmsnorm_mlp", "mlp_out_weight_transpose", "fuse_mlp", "is_eagle_target", "is_eagle_draft",
    "has_pre_attention_norm", "compilation_worker_count", "duplicate_q_weight_sos"]


def test_neuron_config_is_keyword_only_with_the_real_keywords(tnx):
    params = inspect.signature(tnx.NeuronConfig.__init__).parameters
    named = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    assert named == REAL_NEURON_CONFIG_KEYWORDS
    assert params["padding_side"].default == "left" and params["fuse_qkv"].default is False
    cfg = tnx.NeuronConfig(continuous_batching=None, attention_layout="BSH", cache_layout="SBH", padding_side="left",
                       group_query_attention="shard-over-heads", on_device_embedding=False,
                       on_device_generation=None, fuse_qkv=True, compilation_worker_count=4)
    assert cfg.group_query_attention is tnx.GQA.SHARD_OVER_HEADS and cfg.attention_layout == tnx.Layout.BSH
    with pytest.raises(AssertionError, match=r"Unexpected NeuronConfig keyword arguments: \{'fuse_qkvv': True\}"):
        tnx.NeuronConfig(fuse_qkvv=True)
    with pytest.raises(TypeError):
        tnx.NeuronConfig(None)
    with pytest.raises(AssertionError, match="padding_side"):
        tnx.NeuronConfig(padding_side="middle")


def test_gqa_values_match_the_real_strings(tnx):
    assert {g.name: g.value for g in tnx.GQA} == {
        "SHARD_OVER_HEADS": "shard-over-heads", "SHARD_OVER_BATCH": "shard-over-batch",
        "REPLICATED_HEADS": "replicated-heads", "ALL_GATHER_HEADS": "all-gather-heads"}


def test_continuous_batching_and_generation_configs(tnx):
    cb = tnx.ContinuousBatchingConfig(max_num_seqs=4)
    assert cb.batch_size_for_shared_caches == 4
    assert tnx.ContinuousBatchingConfig(batch_size_for_shared_caches=2).max_num_seqs == 2
    with pytest.raises(AssertionError, match="unexpected key word arguments"):
        tnx.ContinuousBatchingConfig(max_num_seqs=2, max_num_seq=3)
    with pytest.raises(TypeError):
        tnx.ContinuousBatchingConfig(4)
    with pytest.raises(KeyError):
        tnx.ContinuousBatchingConfig()
    assert tnx.NeuronConfig(continuous_batching=cb).padding_side == "right"  # forced, like the real one
    params = inspect.signature(tnx.GenerationConfig.__init__).parameters
    assert all(p.kind is p.KEYWORD_ONLY for n, p in params.items() if n != "self")
    assert (params["top_k"].default, params["do_sample"].default, params["temperature"].default) == (50, False, 1.0)
    assert tnx.GenerationConfig(top_p=1, temperature=2).temperature == 2.0
    with pytest.raises(TypeError):
        tnx.GenerationConfig(16)
    with pytest.raises(TypeError):
        tnx.GenerationConfig(max_new_tokens=16)


# ---- 2. construction ----------------------------------------------------------------

def test_llama_for_sampling_signature_and_ignored_kwargs(tnx, tiny_model_dir):
    sig = inspect.signature(tnx.LlamaForSampling.__init__)
    assert str(sig) == ("(self, config, *, n_positions=2048, batch_size=1, amp='f32', tp_degree=2, "
                        "context_length_estimate=None, context_unroll=None, unroll=None, neuron_config=None, "
                        "prefixed_length=0, **kwargs)")
    model = tnx.LlamaForSampling.from_pretrained(tiny_model_dir, n_positions=512, tp_degree=2, batch_sizes=[2])
    assert model.ignored_kwargs == {"batch_sizes": [2]}
    assert model.token_buckets == [128, 256, 512] and model.context_buckets == [64, 128, 256]
    assert not hasattr(model, "_hf"), "weights are read by to_neuron(), not from_pretrained()"
    with pytest.raises(RuntimeError, match="to_neuron"):
        model(torch.tensor([[1, 2]]))


@pytest.mark.parametrize("kwargs, error", [
    (dict(amp="fp16"), ValueError), (dict(batch_size="2"), TypeError), (dict(batch_size=[1, 2.0]), TypeError),
    (dict(n_positions=256.0), TypeError), (dict(context_length_estimate="64"), TypeError),
    (dict(n_positions=128, context_length_estimate=256), AssertionError)])
def test_from_pretrained_rejects_bad_arguments(tnx, tiny_model_dir, kwargs, error):
    with pytest.raises(error):
        tnx.LlamaForSampling.from_pretrained(tiny_model_dir, **kwargs)


def test_from_pretrained_needs_weights(tnx, tiny_model_dir, tmp_path):
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    with pytest.raises(FileNotFoundError):
        tnx.LlamaForSampling.from_pretrained(tmp_path)


def test_auto_model_dispatches_on_model_type(tnx, tiny_model_dir, tmp_path):
    assert isinstance(tnx.NeuronAutoModelForCausalLM.from_pretrained(tiny_model_dir, batch_size=1), tnx.LlamaForSampling)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        tnx.NeuronAutoModelForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(AssertionError, match="not supported by Neuron"):
        tnx.NeuronAutoModelForCausalLM.from_pretrained(tmp_path)


def test_visible_cores_must_cover_tp_degree(tnx, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("NEURON_RT_NUM_CORES", "1")
    with pytest.raises(RuntimeError, match="tp_degree=2"):
        _build(tnx, tiny_model_dir, tp_degree=2)
    monkeypatch.delenv("NEURON_RT_NUM_CORES")
    monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "0-1")
    _build(tnx, tiny_model_dir, tp_degree=2, batch_size=1)


# ---- 4. forward ---------------------------------------------------------------------

def test_forward_matches_hf_logits_and_checks_batch_size(compiled, hf_model, tokenizer):
    ids = tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    compiled.reset()
    logits = compiled(ids)
    assert logits.shape == (1, 2048) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_model(ids).logits[:, -1], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"batch_size : 3.*\[1, 2\]"):
        compiled(ids.repeat(3, 1))


def test_forward_cache_positions(compiled, tokenizer):
    ids = tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    compiled.reset()
    compiled(ids)
    with pytest.raises(ValueError, match="never-written"):
        compiled(torch.tensor([[5]]), torch.tensor([ids.shape[1] + 3]))
    with pytest.raises(ValueError, match=r"max\(n_positions\)=128"):
        compiled(torch.tensor([[5]]), torch.tensor([128]))
    compiled.reset()
    with pytest.raises(ValueError, match="never-written"):
        compiled(torch.tensor([[5]]), torch.tensor([1]))


def test_prompt_longer_than_largest_bucket_still_works_but_is_counted(compiled, hf_model):
    ids = torch.randint(3, 2048, (1, 40), generator=torch.Generator().manual_seed(0))
    compiled.reset()
    before = compiled.slow_context_encodings
    logits = compiled(ids)
    assert compiled.slow_context_encodings == before + 1
    torch.testing.assert_close(logits, hf_model(ids).logits[:, -1], atol=1e-4, rtol=1e-4)
    compiled(ids[:, :20])
    assert compiled.slow_context_encodings == before + 1


def test_reset_is_counted_with_the_bytes_a_real_reset_writes(compiled):
    calls, written = compiled.reset_calls, compiled.reset_bytes
    compiled.reset()
    compiled.reset()
    # tiny model: 4 layers x (k, v) x caches of batch 1 and 2 x 128 positions x 4 KV heads x 32 x 4 bytes (f32)
    assert compiled.kv_cache_bytes() == 4 * 2 * (1 + 2) * 128 * 4 * 32 * 4
    assert (compiled.reset_calls - calls, compiled.reset_bytes - written) == (2, 2 * compiled.kv_cache_bytes())


def test_a_context_encoding_at_position_0_replaces_the_previous_batch_without_reset(compiled, hf_model):
    """As on the device: the new batch's prompt overwrites what it will read, the rest is masked."""
    gen = torch.Generator().manual_seed(3)
    first, second = torch.randint(3, 2048, (1, 30), generator=gen), torch.randint(3, 2048, (1, 7), generator=gen)
    compiled.reset()
    calls = compiled.reset_calls
    compiled(first)
    for position in range(30, 60):  # the first batch fills positions far past the second one's
        compiled(torch.tensor([[5]]), torch.tensor([position]))
    torch.testing.assert_close(compiled(second), hf_model(second).logits[:, -1], atol=1e-4, rtol=1e-4)
    nxt = torch.tensor([[11]])
    torch.testing.assert_close(compiled(nxt, torch.tensor([7])),
                               hf_model(torch.cat([second, nxt], dim=1)).logits[:, -1], atol=1e-4, rtol=1e-4)
    assert compiled.reset_calls == calls


# ---- 5. sample ----------------------------------------------------------------------

def test_greedy_left_padded_batch_equals_hf_generate_of_each_prompt(compiled, hf_model, tokenizer, left_padded):
    input_ids, start_ids = left_padded
    new = 24
    out = compiled.sample(input_ids, sequence_length=input_ids.shape[1] + new, start_ids=start_ids, top_k=1)
    assert out.dtype == torch.long and out.shape == (2, input_ids.shape[1] + new)
    for row, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        ref = hf_model.generate(ids, max_new_tokens=new, do_sample=False)[0, ids.shape[1]:]
        got = out[row, input_ids.shape[1]:]
        assert got[:len(ref)].tolist() == ref.tolist()
        assert (got[len(ref):] == tokenizer.eos_token_id).all()


def test_sample_argument_checks(compiled, left_padded):
    input_ids, start_ids = left_padded
    length = input_ids.shape[1] + 4
    with pytest.raises(ValueError, match="temperature has to be a strictly positive float."):
        compiled.sample(input_ids, length, start_ids=start_ids, top_k=1, temperature=1)
    with pytest.raises(ValueError, match="top_p"):
        compiled.sample(input_ids, length, start_ids=start_ids, top_p=1)
    with pytest.raises(ValueError, match="top_k"):
        compiled.sample(input_ids, length, start_ids=start_ids, top_k=0)
    with pytest.raises(ValueError, match=r"batch_size : 3"):
        compiled.sample(torch.cat([input_ids, input_ids[:1]]), length, top_k=1)
    with pytest.raises(ValueError, match=r"max\(n_positions\)=128"):
        compiled.sample(input_ids, 200, start_ids=start_ids, top_k=1)
    compiled.sample(input_ids, length, start_ids=start_ids, top_k=1, max_new_tokens=4)
    assert compiled.ignored_sample_kwargs == {"max_new_tokens": 4}  # silently ignored, like the real one


def test_sample_defaults_to_top_k_50_sampling(compiled, left_padded):
    input_ids, start_ids = left_padded
    assert str(inspect.signature(compiled.sample)) == (
        "(input_ids, sequence_length, cache_ids=None, start_ids=None, top_k=50, top_p=1.0, eos_token_override=None, "
        "temperature=1.0, streamer=None, stopping_criteria_list=None, no_repeat_ngram_size=None, **kwargs)")
    assert str(inspect.signature(compiled.forward)) == (
        "(input_ids, cache_ids=None, start_ids=None, last_token_id=None, input_embeddings=None, **kwargs)")
    torch.manual_seed(0)
    outs = {tuple(compiled.sample(input_ids, input_ids.shape[1] + 12, start_ids=start_ids)[0].tolist())
            for _ in range(3)}
    assert len(outs) > 1


class Recorder:
    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ends += 1


def test_streamer_gets_only_new_tokens_then_one_end(compiled, left_padded):
    input_ids, start_ids = left_padded
    streamer = Recorder()
    out = compiled.sample(input_ids, input_ids.shape[1] + 6, start_ids=start_ids, top_k=1, streamer=streamer)
    assert streamer.ends == 1
    assert [tuple(p.shape) for p in streamer.puts] == [(2, 1)] * 6
    assert torch.equal(torch.cat(streamer.puts, dim=1), out[:, input_ids.shape[1]:])


def test_eos_fills_finished_rows_and_stops_when_all_done(compiled, left_padded):
    input_ids, start_ids = left_padded
    prompt = input_ids.shape[1]
    free = compiled.sample(input_ids, prompt + 8, start_ids=start_ids, top_k=1)
    eos = int(free[0, prompt + 1])
    out = compiled.sample(input_ids, prompt + 8, start_ids=start_ids, top_k=1, eos_token_override=eos)
    assert out[0, prompt:prompt + 2].tolist() == free[0, prompt:prompt + 2].tolist()
    assert (out[0, prompt + 1:] == eos).all()
    both = [int(free[0, prompt]), int(free[1, prompt])]
    out = compiled.sample(input_ids, prompt + 8, start_ids=start_ids, top_k=1, eos_token_override=both)
    assert out.shape[1] == prompt + 1


def test_on_device_generation_returns_tokens(tnx, tiny_model_dir, compiled, left_padded):
    input_ids, start_ids = left_padded
    cfg = tnx.NeuronConfig(on_device_generation=tnx.GenerationConfig(do_sample=False, eos_token_id=2))
    model = _build(tnx, tiny_model_dir, batch_size=2, neuron_config=cfg)
    out = model.sample(input_ids, input_ids.shape[1] + 8, start_ids=start_ids)
    ref = compiled.sample(input_ids, input_ids.shape[1] + 8, start_ids=start_ids, top_k=1)
    assert torch.equal(out, ref)


def test_hf_generation_adapter_matches_sample(tnx, compiled, tokenizer, left_padded, tiny_model_dir):
    input_ids, start_ids = left_padded
    mask = (torch.arange(input_ids.shape[1])[None] >= start_ids[:, None]).long()
    adapter = tnx.HuggingFaceGenerationModelAdapter(AutoConfig.from_pretrained(tiny_model_dir), compiled)
    got = adapter.generate(input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    ref = compiled.sample(input_ids, input_ids.shape[1] + 8, start_ids=start_ids, top_k=1)
    assert torch.equal(got, ref)


def test_continuous_batching_slots(tnx, tiny_model_dir, hf_model, tokenizer):
    cfg = tnx.NeuronConfig(continuous_batching=tnx.ContinuousBatchingConfig(max_num_seqs=2))
    model = _build(tnx, tiny_model_dir, batch_size=2, context_length_estimate=[32], neuron_config=cfg)
    assert model.context_batch_sizes == [1]
    prompts = [tokenizer(p, return_tensors="pt").input_ids for p in PROMPTS]
    last = []
    for seq, ids in reversed(list(enumerate(prompts))):
        logits = model(ids, torch.arange(ids.shape[1])[None], torch.tensor([seq]))
        last.insert(0, logits.argmax(-1))
    tokens = [[int(t)] for t in last]
    positions = torch.tensor([[p.shape[1]] for p in prompts])
    for _ in range(5):
        nxt = torch.tensor([[t[-1]] for t in tokens])
        logits = model(nxt, positions, torch.tensor([0, 1]))
        for row, tok in enumerate(logits.argmax(-1).tolist()):
            tokens[row].append(tok)
        positions = positions + 1
    for row, ids in enumerate(prompts):
        ref = hf_model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
        assert tokens[row] == ref.tolist()[:6]
    with pytest.raises(ValueError, match="slots"):
        model(torch.tensor([[5]]), torch.tensor([[3]]), torch.tensor([2]))


def test_continuous_batching_with_one_sequence_fails_in_to_neuron_like_the_real_context_insert(tnx, tiny_model_dir):
    """layers/attention.py fused_kv_update_cache: inserting a prompt needs n_seqs > n_active_seqs (1)."""
    cfg = tnx.NeuronConfig(continuous_batching=tnx.ContinuousBatchingConfig(max_num_seqs=1))
    model = tnx.LlamaForSampling.from_pretrained(tiny_model_dir, batch_size=1, n_positions=128,
                                                 context_length_estimate=[16, 32], neuron_config=cfg)
    before = _stats(tnx)
    with pytest.raises(NotImplementedError, match=r"^Updating 2D cache_ids is not implemented for n_active_tokens=16, "
                                                  r"n_positions=16, n_seqs=1, n_active_seqs=1\.$"):
        model.to_neuron()
    assert _stats(tnx) == before, "nothing compiles: the HLO cannot even be built"


# ---- 3. persistent cache ------------------------------------------------------------

def test_first_compile_misses_and_writes_the_real_layout(tnx, tiny_model_dir, cache_dir):
    before = _stats(tnx)
    model = _build(tnx, tiny_model_dir)
    graphs = [(e["graph"], e["bucket"], e["batch_size"]) for e in model.compile_log]
    assert graphs == [("context", 16, 1), ("context", 16, 2), ("context", 32, 1), ("context", 32, 2),
                      ("token", 128, 1), ("token", 128, 2)]
    assert not any(e["hit"] for e in model.compile_log)
    assert _stats(tnx)["misses"] - before["misses"] == 6 and _stats(tnx)["hits"] == before["hits"]
    version_dir = cache_dir / "neuronxcc-2.16.345.0"
    modules = sorted(version_dir.iterdir())
    assert len(modules) == 6
    for entry in model.compile_log:
        path = Path(entry["module_dir"])
        assert path.parent == version_dir
        hlo, flags = path.name.removeprefix("MODULE_").split("+")
        assert len(hlo) == 20 and flags == "39f12043" and hlo == entry["hlo_hash"]
        assert sorted(p.name for p in path.iterdir()) == [
            "compile_flags.json", "model.done", "model.hlo_module.pb", "model.neff"]
        assert json.loads((path / "compile_flags.json").read_text()) == [
            "--model-type=transformer", "--auto-cast=none", "--execute-repetition=1"]


def test_same_settings_hit_and_changes_miss(tnx, tiny_model_dir, cache_dir, monkeypatch):
    first = _build(tnx, tiny_model_dir)
    before = _stats(tnx)
    second = _build(tnx, tiny_model_dir)
    assert all(e["hit"] for e in second.compile_log)
    assert _stats(tnx)["hits"] - before["hits"] == 6 and _stats(tnx)["misses"] == before["misses"]
    assert [e["module_dir"] for e in second.compile_log] == [e["module_dir"] for e in first.compile_log]

    assert not any(e["hit"] for e in _build(tnx, tiny_model_dir, batch_size=4).compile_log)
    assert not any(e["hit"] for e in _build(tnx, tiny_model_dir, amp="bf16").compile_log)
    monkeypatch.setenv("FAKE_NEURON_DEVICES", "4")  # 8 NeuronCores for tp_degree 8
    assert not any(e["hit"] for e in _build(tnx, tiny_model_dir, tp_degree=8).compile_log)
    monkeypatch.delenv("FAKE_NEURON_DEVICES")
    assert not any(e["hit"] for e in _build(tnx, tiny_model_dir, neuron_config=tnx.NeuronConfig(fuse_qkv=True)).compile_log)

    monkeypatch.setenv("NEURON_CC_FLAGS", "-O1")
    flagged = _build(tnx, tiny_model_dir)
    assert not any(e["hit"] for e in flagged.compile_log)
    assert [e["hlo_hash"] for e in flagged.compile_log] == [e["hlo_hash"] for e in first.compile_log]
    assert json.loads((Path(flagged.compile_log[0]["module_dir"]) / "compile_flags.json").read_text())[0] == "-O1"
    monkeypatch.delenv("NEURON_CC_FLAGS")

    monkeypatch.setenv("FAKE_NEURONXCC_VERSION", "2.16.372.0")
    assert sys.modules["neuronxcc"].__version__ == "2.16.372.0"
    upgraded = _build(tnx, tiny_model_dir)
    assert not any(e["hit"] for e in upgraded.compile_log)
    assert (cache_dir / "neuronxcc-2.16.372.0").is_dir()


def test_cache_key_hashes_follow_the_real_functions(tnx):
    """compiler.get_hash_module (cache key: str(hlo), no flags) and base.hash_hlo (save/load names:
    the serialized HLO) are different hashes of the same graph."""
    hlo = {"graph": "token", "bucket": 128, "batch_size": 2}
    text = tnx.compiler.hlo_text(hlo)
    assert tnx.compiler.get_hash_module(hlo, None) == hashlib.sha256(text.encode()).hexdigest()[:20]
    assert tnx.compiler.get_hash_module(hlo, "--a=1 --b") == hashlib.sha256((text + "--a=1--b").encode()).hexdigest()[:20]
    assert tnx.base.hash_hlo(hlo) == hashlib.sha256(tnx.compiler.serialize(hlo)).hexdigest()[:20] + ".neff"
    assert tnx.base.hash_hlo(hlo)[:20] != tnx.compiler.get_hash_module(hlo, None)


def test_flags_hash_is_md5_of_the_json_flag_list_like_a_real_cache_entry(tnx):
    """MODULE_5ac5ea8b15390a9a05af+39f12043 is a real entry compiled with the default flags (SDK 2.20)."""
    flags = tnx.compiler.compile_flags()
    assert flags == ["--model-type=transformer", "--auto-cast=none", "--execute-repetition=1"]
    assert tnx.compiler.hash_flags(flags) == "39f12043"
    assert tnx.compiler.hash_flags(["-O1", *flags[1:]]) != "39f12043"


def test_compilation_worker_count_does_not_change_the_key(tnx, tiny_model_dir):
    _build(tnx, tiny_model_dir)
    again = _build(tnx, tiny_model_dir, neuron_config=tnx.NeuronConfig(compilation_worker_count=2))
    assert all(e["hit"] for e in again.compile_log)


def test_cache_location_rules(tnx, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL")
    assert tnx.compiler.cache_root() == "/var/tmp/neuron-compile-cache"
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "url"))
    monkeypatch.setenv("NEURON_CC_FLAGS", f"--cache_dir={tmp_path / 'flag'} --model-type=transformer")
    model = _build(tnx, tiny_model_dir, batch_size=1)
    assert all(e["module_dir"].startswith(str(tmp_path / "flag")) for e in model.compile_log)
    assert not (tmp_path / "url").exists()
    assert "--cache_dir" not in (Path(model.compile_log[0]["module_dir"]) / "compile_flags.json").read_text()
    monkeypatch.delenv("NEURON_CC_FLAGS")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", "s3://bucket/neuron-cache")
    with pytest.raises(ValueError, match="local"):
        _build(tnx, tiny_model_dir, batch_size=1)


def test_compile_time_is_simulated_on_misses_only(tnx, tiny_model_dir, monkeypatch):
    # The simulated compile time is read from the double's sleep calls, not the wall clock:
    # loading the model around it takes a varying time on a busy machine.
    import importlib

    double_base = importlib.import_module(f"{tnx.__name__}.base")
    slept = []
    monkeypatch.setattr(double_base.time, "sleep", slept.append)
    monkeypatch.setenv("FAKE_NEURON_COMPILE_SECONDS", "0.1")
    cfg = tnx.NeuronConfig(compilation_worker_count=2)
    _build(tnx, tiny_model_dir, neuron_config=cfg)  # 6 misses, 2 at a time -> 0.3 s
    assert sum(slept) == pytest.approx(0.3)
    slept.clear()
    _build(tnx, tiny_model_dir, neuron_config=cfg)  # all hits
    assert sum(slept) == 0


def test_save_and_load_round_trip(tnx, tiny_model_dir, tmp_path, monkeypatch, left_padded):
    model = _build(tnx, tiny_model_dir)
    artifacts = tmp_path / "artifacts"
    model.save(str(artifacts))
    assert sorted(p.name for p in artifacts.iterdir()) == sorted(e["neff_file"] for e in model.compile_log)
    # save()'s names hash the serialized HLO; the cache key hashes its text form: never the same
    assert all(e["neff_file"] != f"{e['hlo_hash']}.neff" for e in model.compile_log)

    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "empty-cache"))
    before = _stats(tnx)
    loaded = tnx.LlamaForSampling.from_pretrained(tiny_model_dir, **SMALL)
    loaded.load(str(artifacts))
    loaded.to_neuron()
    assert (_stats(tnx)["hits"], _stats(tnx)["misses"]) == (before["hits"], before["misses"])
    assert _stats(tnx)["loaded"] - before["loaded"] == 6
    assert not (tmp_path / "empty-cache").exists()
    input_ids, start_ids = left_padded
    assert torch.equal(loaded.sample(input_ids, input_ids.shape[1] + 4, start_ids=start_ids, top_k=1),
                       model.sample(input_ids, input_ids.shape[1] + 4, start_ids=start_ids, top_k=1))

    other = tnx.LlamaForSampling.from_pretrained(tiny_model_dir, **{**SMALL, "n_positions": 256})
    other.load(str(artifacts))
    with pytest.raises(FileNotFoundError, match="matching NEFF"):
        other.to_neuron()
    next(artifacts.iterdir()).unlink()
    broken = tnx.LlamaForSampling.from_pretrained(tiny_model_dir, **SMALL)
    broken.load(str(artifacts))  # load() only records the directory
    with pytest.raises(FileNotFoundError):
        broken.to_neuron()


def test_save_needs_a_compiled_model(tnx, tiny_model_dir, tmp_path):
    with pytest.raises(AssertionError, match="not been successfully compiled"):
        tnx.LlamaForSampling.from_pretrained(tiny_model_dir).save(str(tmp_path / "x"))


# ---- 6. legacy split checkpoint -----------------------------------------------------

def test_save_pretrained_split_layout_loads(tnx, tiny_model_dir, hf_model, tmp_path, tokenizer):
    split = tmp_path / "split"
    tnx.module.save_pretrained_split(hf_model, str(split))
    assert (split / "config.json").is_file()
    names = json.loads((split / "pytorch_model.bin" / "key_to_filename.json").read_text())
    assert names["model.embed_tokens.weight"].startswith("p0.")
    assert all((split / "pytorch_model.bin" / name).is_file() for name in names.values())
    model = _build(tnx, split, batch_size=1)
    ids = tokenizer(PROMPTS[:1], return_tensors="pt").input_ids
    torch.testing.assert_close(model(ids), hf_model(ids).logits[:, -1], atol=1e-4, rtol=1e-4)


# ---- 7. select_tokens ---------------------------------------------------------------

def test_select_tokens(tnx):
    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    assert torch.equal(tnx.sampling.select_tokens(scores), scores.argmax(-1, keepdim=True))
    assert torch.equal(tnx.sampling.select_tokens(scores, top_k=50, top_p=1e-6), scores.argmax(-1, keepdim=True))
    picked = tnx.sampling.select_tokens(scores, top_k=5)
    assert picked.shape == (3, 1) and bool((scores.gather(1, picked) >= scores.topk(5).values[:, -1:]).all())


# ---- NeuronCores: one process each ---------------------------------------------------

HOLDER = """
import sys
from torch_neuronx import _fake_nrt
print(_fake_nrt.init(), flush=True)
sys.stdin.read()  # hold the cores until the test closes stdin
"""


def hold_cores(**env):
    """Another process that takes NeuronCores (on this test's registry) and keeps them until released."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(DOUBLE), **env})
    proc.cores = json.loads(proc.stdout.readline())
    return proc


def release(proc):
    proc.stdin.close()
    proc.wait(timeout=30)


def test_a_neuron_core_belongs_to_one_process_until_it_exits(tnx, tiny_model_dir):
    holder = hold_cores(NEURON_RT_VISIBLE_CORES="0-1")
    try:
        assert holder.cores == [0, 1]
        with pytest.raises(RuntimeError, match=rf"Logical Neuron Core\(s\) not available - Requested:2 Available:0; "
                                               rf"held by another process: nc0 \(pid {holder.pid}\), nc1 \(pid {holder.pid}\)"):
            _build(tnx, tiny_model_dir, batch_size=1)
        listed = json.loads(subprocess.run([str(DOUBLE / "bin" / "neuron-ls"), "-j"], check=True, capture_output=True,
                                           text=True).stdout)
        assert [p["pid"] for p in listed[0]["neuron_processes"]] == [holder.pid]
    finally:
        release(holder)
    model = _build(tnx, tiny_model_dir, batch_size=1)  # the exited process's claim is stale
    assert model.neuron_cores == [0, 1]
    assert _build(tnx, tiny_model_dir, batch_size=1).neuron_cores == [0, 1]  # this process already holds them


def test_the_runtime_gives_free_cores_or_the_ones_named(tnx, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("FAKE_NEURON_DEVICES", "2")  # 4 NeuronCores
    holder = hold_cores(NEURON_RT_NUM_CORES="2")
    try:
        assert holder.cores == [0, 1]
        monkeypatch.setenv("NEURON_RT_NUM_CORES", "2")
        assert _build(tnx, tiny_model_dir, batch_size=1).neuron_cores == [2, 3]
        monkeypatch.delenv("NEURON_RT_NUM_CORES")
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "1-2")
        with pytest.raises(RuntimeError, match=rf"Requested:nc1-nc2 .*held by another process: nc1 \(pid {holder.pid}\)\. "):
            _build(tnx, tiny_model_dir, batch_size=1)
        monkeypatch.setenv("NEURON_RT_VISIBLE_CORES", "4-5")
        with pytest.raises(RuntimeError, match="this host has 4"):
            _build(tnx, tiny_model_dir, batch_size=1)
    finally:
        release(holder)


# ---- SDK packaging, versions and neuron-ls ----------------------------------------------

def test_versions(tnx, monkeypatch):
    import neuronxcc
    import torch_neuronx

    assert tnx.__version__ == "0.13.322" and torch_neuronx.__version__ == "2.5.1.2.4.0"
    assert neuronxcc.__version__ == "2.16.345.0"
    monkeypatch.setenv("FAKE_NEURONXCC_VERSION", "2.14.227.0")
    assert neuronxcc.__version__ == "2.14.227.0"


def test_versions_are_the_sdk_release_pinned_in_requirements_neuron(tnx):
    import neuronxcc
    import torch_neuronx

    pins = dict(line.split("==") for line in (ROOT / "requirements-neuron.txt").read_text().splitlines()
                if "==" in line and not line.lstrip().startswith("#"))
    double = {"neuronx-cc": neuronxcc.__version__, "torch-neuronx": torch_neuronx.__version__,
              "transformers-neuronx": tnx.__version__}
    assert double == {name: pins[name] for name in double}


def test_neuron_ls(monkeypatch):
    tool = DOUBLE / "bin" / "neuron-ls"
    assert os.access(tool, os.X_OK)
    env = {**os.environ, "FAKE_NEURON_DEVICES": "2"}
    devices = json.loads(subprocess.run([str(tool), "--json-output"], env=env, check=True,
                                        capture_output=True, text=True).stdout)
    assert [d["neuron_device"] for d in devices] == [0, 1]
    assert sum(d["nc_count"] for d in devices) == 4
    text = subprocess.run([str(tool)], env={**os.environ}, check=True, capture_output=True, text=True).stdout
    assert "inf2.xlarge" in text and "| 0 " in text
