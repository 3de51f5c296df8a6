"""The Neuron backend, the build step and the handler against the Neuron SDK test double."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from llama_engine import Engine, GenerationRequest, RequestError, SamplingParams, load_model_config
from llama_engine.compile_cache import CompileCacheError
from llama_engine.config import HandlerConfig
from scripts import build_model

from conftest import ROOT
from neuron_env import neuron_double

CONFIG = ROOT / "model-config" / "tiny-llama-neuron.yaml"
PROMPTS = ["The function returns", "If the object is a list of values, then", "A", "When the file"]


@pytest.fixture(scope="module")
def built(tiny_model_dir, tmp_path_factory):
    """The tiny model built for Neuron with the double: build dir and model store."""
    work = tmp_path_factory.mktemp("neuron-build")
    with neuron_double(NEURON_COMPILE_CACHE_URL=str(work / "unused-cache")):
        build_model.main(["--config", str(CONFIG), "--checkpoint", str(tiny_model_dir), "--name", "tiny-llama-neuron",
                          "--build-dir", str(work / "build"), "--export-path", str(work / "store")])
    return work / "store" / "tiny-llama-neuron"


@pytest.fixture()
def double(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_COMPILE_CACHE_DIR", str(tmp_path / "writable"))
    with neuron_double():
        yield


def load_cfg():
    return load_model_config(yaml.safe_load(CONFIG.read_text()))


def engine_from(model_dir, **handler_overrides):
    cfg = load_cfg()
    for key, value in handler_overrides.items():
        setattr(cfg.handler, key, value)
    return Engine.from_config(cfg.handler, str(model_dir), batch_size=cfg.micro_batching.micro_batch_size)


def test_build_ships_the_saved_graphs_and_a_manifest(built):
    manifest = json.loads((built / "compile_cache" / "manifest.json").read_text())
    assert manifest["kind"] == "neuron"
    assert manifest["versions"]["neuronx-cc"] == "2.16.345.0"
    assert manifest["versions"]["transformers-neuronx"] and manifest["versions"]["torch-neuronx"]
    assert manifest["settings"] == {"tp_degree": 2, "amp": "f32", "batch_size": 4, "n_positions": [256],
                                    "context_length_estimate": [32, 64], "gqa": "shard-over-heads",
                                    "neuron_cc_flags": "--model-type=transformer"}
    # model.save(): one <hash_hlo>.neff per graph (two context buckets and the token graph, at batch 4);
    # the persistent cache the build compiled through stays on the build host
    assert sorted(rel.split("/")[0] for rel in manifest["files"]) == ["neff"] * 3
    assert all(rel.endswith(".neff") and len(rel.split("/")[1]) == 25 for rel in manifest["files"])


def test_load_from_shipped_cache_compiles_nothing_and_matches_torch(built, double, tiny_model_dir):
    import transformers_neuronx

    transformers_neuronx.reset_compiler_stats()
    engine = engine_from(built)
    engine.warmup(batch_size=4)
    assert transformers_neuronx.compiler_stats == {"hits": 0, "misses": 0, "loaded": 3}, "model.load(), no cache lookup"
    assert engine.backend.compile_session.report() == {"kind": "neuron", "shipped_entries": 3, "new_entries": 0}
    assert engine.backend.model.ignored_kwargs == {}, "a keyword the real SDK would silently ignore"
    torch_engine = Engine.from_config(HandlerConfig(model_path=tiny_model_dir.name, max_length=256, dtype="float32"),
                                      str(tiny_model_dir.parent))
    prepared = [engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=10))) for p in PROMPTS[:3]]
    got = engine.generate(prepared)
    want = [torch_engine.generate([p])[0] for p in prepared]
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


def test_changed_compiler_version_is_refused(built, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_COMPILE_CACHE_DIR", str(tmp_path / "writable"))
    with neuron_double(FAKE_NEURONXCC_VERSION="2.17.0.0"):
        with pytest.raises(CompileCacheError, match=r"neuronx-cc: compiled with 2\.16\.345\.0, installed 2\.17\.0\.0"):
            engine_from(built)


def test_tampered_neff_is_refused(built, double, tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(built, copy, symlinks=True)
    neff = next((copy / "compile_cache" / "neff").glob("*.neff"))
    neff.write_bytes(b"tampered")
    with pytest.raises(CompileCacheError, match=r"checksum mismatch in cache file neff/[0-9a-f]{20}\.neff"):
        engine_from(copy)


def test_allow_recompile_compiles_at_load_instead(built, double, tmp_path):
    import transformers_neuronx

    copy = tmp_path / "model"
    shutil.copytree(built, copy, symlinks=True)
    shutil.rmtree(copy / "compile_cache")
    transformers_neuronx.reset_compiler_stats()
    engine_from(copy, allow_recompile=True)
    assert transformers_neuronx.compiler_stats["misses"] == 3


def changed_checkpoint_config(built, tmp_path):
    """A copy of the artifact whose checkpoint config differs in a way the manifest does not see,
    but the graphs do (as a different checkpoint dropped into the model directory would)."""
    copy = tmp_path / "model"
    shutil.copytree(built, copy)
    config = json.loads((copy / "model" / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (copy / "model" / "config.json").write_text(json.dumps(config))
    return copy


def test_a_graph_that_does_not_match_fails_the_load_without_compiling(built, double, tmp_path):
    import transformers_neuronx

    copy = changed_checkpoint_config(built, tmp_path)
    transformers_neuronx.reset_compiler_stats()
    with pytest.raises(CompileCacheError, match=r"(?s)do not match this model: Could not find a matching NEFF.*"
                                                 r"Nothing was compiled.*allow_recompile: true"):
        engine_from(copy)
    assert transformers_neuronx.compiler_stats["misses"] == 0


def test_allow_recompile_compiles_a_graph_miss_through_the_persistent_cache(built, double, tmp_path):
    import transformers_neuronx

    copy = changed_checkpoint_config(built, tmp_path)
    transformers_neuronx.reset_compiler_stats()
    engine = engine_from(copy, allow_recompile=True)
    assert transformers_neuronx.compiler_stats["misses"] == 3
    assert engine.backend.compile_session.report()["new_entries"] == 3
    assert engine.generate([engine.prepare(GenerationRequest("Hello", SamplingParams(max_new_tokens=3)))])[0].token_ids


@pytest.mark.parametrize("flags", ["-O1", "--model-type=transformer --cache_dir=/tmp/elsewhere"])
def test_compiler_flags_from_the_environment_that_differ_are_refused(built, tmp_path, monkeypatch, flags):
    monkeypatch.setenv("LLAMA_COMPILE_CACHE_DIR", str(tmp_path / "writable"))
    with neuron_double(NEURON_CC_FLAGS=flags):
        import transformers_neuronx

        transformers_neuronx.reset_compiler_stats()
        with pytest.raises(RuntimeError, match=r"NEURON_CC_FLAGS=.* differs from handler\.neuron_cc_flags "
                                               r"'--model-type=transformer'"):
            engine_from(built, allow_recompile=True)
        assert transformers_neuronx.compiler_stats == {"hits": 0, "misses": 0, "loaded": 0}


def test_compilation_worker_count_reaches_neuron_config(built, double, tmp_path, monkeypatch):
    import importlib
    from types import SimpleNamespace

    copy = tmp_path / "model"
    shutil.copytree(built, copy)
    shutil.rmtree(copy / "compile_cache")
    slept = []  # the double's simulated compile time, one sleep per wave of compiles
    monkeypatch.setattr(importlib.import_module("transformers_neuronx.base"), "time", SimpleNamespace(sleep=slept.append))
    monkeypatch.setenv("FAKE_NEURON_COMPILE_SECONDS", "10")
    engine = engine_from(copy, allow_recompile=True, compilation_worker_count=2)
    assert engine.backend.model.neuron_config.compilation_worker_count == 2
    assert sum(slept) == 20  # 3 graphs, 2 at a time: two waves
    assert load_cfg().handler.compilation_worker_count is None  # tiny-llama-neuron.yaml: every graph at once


def test_many_batches_make_no_reset_and_match_torch(built, double, tiny_model_dir):
    """No model.reset() between batches (a host write of every KV cache on the device):
    each batch's context encoding replaces what the previous batch left."""
    engine = engine_from(built)
    torch_engine = Engine.from_config(HandlerConfig(model_path=tiny_model_dir.name, max_length=256, dtype="float32"),
                                      str(tiny_model_dir.parent))
    batches = [PROMPTS, PROMPTS[2:], [" ".join(["word"] * 40)], PROMPTS[:1], PROMPTS[1:3]]
    for prompts, new in zip(batches, (12, 5, 30, 3, 8)):
        prepared = [engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=new))) for p in prompts]
        got = engine.generate(prepared)
        assert [g.token_ids for g in got] == [torch_engine.generate([p])[0].token_ids for p in prepared]
    assert engine.backend.model.reset_calls == 0


def test_shape_contract_errors_name_the_limit(built, double):
    engine = engine_from(built)
    assert engine.backend.max_prompt_length == 64  # the largest context_length_estimate bucket caps prompts
    long_prompt = " ".join(["word"] * 80)
    with pytest.raises(RequestError) as info:
        engine.prepare(GenerationRequest(long_prompt))
    assert info.value.parameter == "inputs" and "largest compiled context bucket" in info.value.message
    with pytest.raises(RequestError) as info:
        engine.prepare(GenerationRequest("Hello", SamplingParams(max_new_tokens=255)))
    assert info.value.parameter == "max_new_tokens" and "256" in info.value.message


def test_batch_is_padded_to_the_compiled_size_and_split_when_positions_would_overrun(built, double):
    engine = engine_from(built)
    calls = []
    original = engine.backend.model.forward
    engine.backend.model.forward = lambda ids, **kw: calls.append(tuple(ids.shape)) or original(ids, **kw)
    long_prompt = " ".join(["word"] * 60)
    prepared = [engine.prepare(GenerationRequest(long_prompt, SamplingParams(max_new_tokens=8))),
                engine.prepare(GenerationRequest("Hi", SamplingParams(max_new_tokens=230)))]
    results = engine.generate(prepared)
    assert [r.generated_tokens for r in results][0] == 8
    prefills = [shape for shape in calls if shape[1] > 1]
    assert len(prefills) == 2, "a 60-token prompt plus a 230-token answer cannot share 256 positions"
    assert all(shape[0] == 4 for shape in calls)


def test_too_few_cores_is_a_clear_error(built, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_COMPILE_CACHE_DIR", str(tmp_path / "writable"))
    with neuron_double(FAKE_NEURON_DEVICES="0"):
        with pytest.raises(RuntimeError, match=r"tp_degree 2 needs 2 NeuronCores, this host has 0"):
            engine_from(built)


def test_sdk_sample_streams_the_same_text_as_the_engine(built, double, tiny_model_dir):
    """transformers-neuronx's own sample() puts [B,1] tokens and never the prompt: each row's
    tokens, through that request's generation (the engine's per-token path), give the text
    the engine's own decoding gives."""
    import torch

    from llama_engine.streamer import BatchTextStreamer

    engine = engine_from(built)
    prepared = [engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=6))) for p in PROMPTS]
    streamer = BatchTextStreamer([engine.lifecycle.start(p) for p in prepared])

    class SdkStreamer:  # the SDK's streamer protocol: put(LongTensor[B, 1]) per token, then end()
        def put(self, tokens):
            streamer.put_rows(range(len(prepared)), tokens.reshape(-1))

        def end(self):
            pass

    input_ids, mask = engine._pad_batch([p.prompt_ids for p in prepared], 4)
    model = engine.backend.model
    model.reset()
    model.sample(input_ids, input_ids.shape[1] + 6, start_ids=mask.argmax(dim=1).to(torch.int32), top_k=1,
                 streamer=SdkStreamer())
    expected = engine.generate(prepared)
    assert streamer.finished
    assert [r.text for r in streamer.results()] == [r.text for r in expected]


def test_per_row_parameters_hold_on_the_neuron_backend(built, double):
    from llama_engine.request import GenerationRequest as Request

    engine = engine_from(built)
    rows = [Request("The function returns", SamplingParams(max_new_tokens=8)),
            Request("If the object is", SamplingParams(max_new_tokens=8, do_sample=True, temperature=0.8, seed=11)),
            Request("A list of", SamplingParams(max_new_tokens=8, repetition_penalty=1.4, stop=["\n"]))]
    alone = [engine.generate([engine.prepare(r)])[0] for r in rows]
    batched = engine.generate([engine.prepare(r) for r in rows])
    assert [(b.token_ids, b.finish_reason) for b in batched] == [(a.token_ids, a.finish_reason) for a in alone]
