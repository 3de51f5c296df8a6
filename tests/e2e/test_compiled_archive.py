"""torch.compile artifacts shipped in the archive: TorchServe loads them without compiling,
from a read-only model store, and streams the same tokens as the eager backend."""
from __future__ import annotations

import json
import re

import pytest
import requests

from scripts.tsctl import running

from conftest import ROOT, build_model
from readonly import guarded_read_only_view

MODEL = "tiny-llama-compiled"


@pytest.fixture(scope="module")
def compiled_store(tiny_model_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("compiled")
    build_model.main(["--config", str(ROOT / "model-config" / f"{MODEL}.yaml"), "--checkpoint", str(tiny_model_dir),
                      "--build-dir", str(work / "build"), "--export-path", str(work / "store")])
    return work / "store"


@pytest.fixture(scope="module")
def compiled_server(compiled_store, tmp_path_factory):
    with guarded_read_only_view(compiled_store, tmp_path_factory.mktemp("ro") / "store") as (store, mounted):
        with running(tmp_path_factory.mktemp("ts-compiled"), store, models=MODEL, timeout=600) as ts:
            ts.read_only_mount = mounted
            yield ts


def compile_report(log: str) -> dict:
    reports = re.findall(r"compile cache: (\{.*\})", log)
    assert reports, "the handler did not report on the compile cache"
    return json.loads(reports[-1])


def test_archive_ships_cache_and_manifest(compiled_store):
    cache = compiled_store / MODEL / "compile_cache"
    manifest = json.loads((cache / "manifest.json").read_text())
    assert manifest["kind"] == "inductor" and manifest["settings"]["batch_size"] == 8
    assert manifest["files"] and all((cache / rel).is_file() for rel in manifest["files"])


def test_served_from_read_only_store_with_no_new_compiles(compiled_server):
    report = compile_report(compiled_server.model_log())
    assert report["new_entries"] == 0
    assert report["fxgraph_cache_miss"] == 0 and report["fxgraph_cache_hit"] >= 1


def test_compile_cache_hits_and_misses_are_on_the_metrics_api(compiled_server):
    from scripts.scrape_metrics import scrape, value

    report = compile_report(compiled_server.model_log())
    samples = scrape(compiled_server.url("metrics"))
    hits = value(samples, "llama_compile_cache_hits_total", MODEL, kind="inductor")
    assert hits == report["fxgraph_cache_hit"] >= 1
    misses = [v for (name, labels), v in samples.items()
              if name == "llama_compile_cache_misses_total" and {("ModelName", MODEL), ("kind", "inductor")} <= labels]
    assert misses == [0.0]  # recorded as 0, not absent


def test_compiled_stream_equals_eager_greedy(compiled_server, tiny_model_dir):
    from llama_engine import Engine, GenerationRequest, SamplingParams
    from llama_engine.config import HandlerConfig

    eager = Engine.from_config(HandlerConfig(model_path=tiny_model_dir.name, max_length=512, dtype="float32"),
                               str(tiny_model_dir.parent))  # the compiled config's dtype, not this CPU's auto
    prompt = "The function returns"
    ref = eager.generate([eager.prepare(GenerationRequest(prompt, SamplingParams(max_new_tokens=12)))])[0]
    r = requests.post(f"{compiled_server.url()}/predictions/{MODEL}", timeout=120, stream=True,
                      json={"inputs": prompt, "parameters": {"max_new_tokens": 12}},
                      headers={"Authorization": f"Bearer {compiled_server.key}"})
    lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [line["token"]["id"] for line in lines] == ref.token_ids
    assert lines[-1]["generated_text"] == ref.text
