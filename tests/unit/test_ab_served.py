"""scripts.bench.ab_served: which checkpoint, GGUF and llama-server build a comparison uses."""
from llama_engine.cpu import CLASS_ENV
from scripts.bench import ab_served, systems
from scripts.bench.systems import LlamaCppSystem


def test_llama_server_reads_the_checkpoints_gguf_and_the_emulated_class_build(tmp_path, monkeypatch):
    monkeypatch.setattr(LlamaCppSystem, "detect", lambda self: (True, "stub: not started"))
    monkeypatch.setenv(CLASS_ENV, "avx2")
    peer = ab_served.make_system("llama-server:t1", 1, tmp_path, "float32", 2, "bfloat16")
    assert peer.gguf == systems.PEERS / "bench-model-bf16.gguf"
    assert peer.cpu_class == "avx2" and peer.decode_threads == 1
    monkeypatch.delenv(CLASS_ENV)
    peer = ab_served.make_system("llama-server", 0, tmp_path, "float32", 2, "float32")
    assert peer.gguf == systems.PEERS / "bench-model-fp32.gguf" and peer.cpu_class is None
