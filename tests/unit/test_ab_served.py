"""scripts.bench.ab_served: which checkpoint, GGUF and llama-server build a comparison uses."""
from llama_engine.cpu import CLASS_ENV
from scripts.bench import ab_served, systems
from scripts.bench.systems import LlamaCppSystem


def test_llama_server_reads_the_checkpoints_gguf_and_the_emulated_class_build(tmp_path, monkeypatch):
    from llama_engine import cpu

    monkeypatch.setattr(LlamaCppSystem, "detect", lambda self: (True, "stub: not started"))
    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: frozenset({"avx2", "f16c", "avx512f", "avx512_bf16"}))
    peer = ab_served.make_system("llama-server", 0, tmp_path, "float32", 2, "bfloat16")
    assert peer.gguf == systems.PEERS / "bench-model-bf16.gguf" and peer.cpu_class is None
    monkeypatch.setenv(CLASS_ENV, "avx2")  # no native bf16: llama.cpp's faster 16-bit type there
    peer = ab_served.make_system("llama-server:t1", 1, tmp_path, "float32", 2, "bfloat16")
    assert peer.gguf == systems.PEERS / "bench-model-f16.gguf"
    assert peer.cpu_class == "avx2" and peer.decode_threads == 1
    monkeypatch.delenv(CLASS_ENV)
    peer = ab_served.make_system("llama-server", 0, tmp_path, "float32", 2, "float32")
    assert peer.gguf == systems.PEERS / "bench-model-fp32.gguf" and peer.cpu_class is None


def test_a_llamacpp_variant_is_served_on_the_gguf_type_its_config_names(tmp_path, monkeypatch):
    import yaml

    monkeypatch.setattr(systems.TorchServeSystem, "build", lambda self: None)
    base = yaml.safe_load((ab_served.ROOT / "model-config" / "bench-llama-llamacpp.yaml").read_text())
    for own, want in (("q8_0", "q8_0"), (None, "auto")):
        if own:
            base["handler"]["gguf_type"] = own
        else:
            base["handler"].pop("gguf_type")
        variant = tmp_path / f"lc-{own}.yaml"
        variant.write_text(yaml.safe_dump(base))
        ab_served.make_system(str(variant), 0, tmp_path, "float32", 2, "bfloat16")
        served = yaml.safe_load((tmp_path / "variant0.yaml").read_text())["handler"]
        assert served["gguf_type"] == want and "dtype" not in served


class _FakeServer:
    """A served variant whose speed is ``rate``, and 1.1x that when it was started after the other one."""

    started = []

    def __init__(self, rate: float, model_log: str = None):
        self.rate = rate
        if model_log is not None:  # a TorchServe variant: its worker's log
            self.server = type("Server", (), {"model_log": lambda _: model_log})()

    def start(self, timeout):
        _FakeServer.started.append(self)
        return self

    def stop(self):
        if self in _FakeServer.started:
            _FakeServer.started.remove(self)

    def speed(self) -> float:
        return self.rate * (1.1 if _FakeServer.started.index(self) == 1 else 1.0)


def test_both_start_orders_cancel_the_bias_of_the_server_started_second(tiny_model_dir, monkeypatch, capsys):
    log = ("x MODEL_LOG - decode_threads auto: 2 threads to start; steps of one row as served choose between 2 and 1\n"
           "x MODEL_LOG - decode_threads auto: one-row steps as served came every 8.00 ms on 2 threads, 9.00 ms on 1 "
           "thread (medians of 18); 2 for one token\n")
    servers = [_FakeServer(100.0), _FakeServer(120.0, log)]
    monkeypatch.setattr(ab_served, "make_system", lambda variant, index, *args: servers[index])
    monkeypatch.setattr("scripts.bench.model.model_dir", lambda checkpoint: tiny_model_dir)
    monkeypatch.setattr("scripts.streaming_client.run_wave", lambda server, prompts, tokens, timeout: server.speed())
    monkeypatch.setattr("scripts.bench.stats.summarize", lambda speed: {"output_tokens_per_s": speed})
    assert ab_served.main(["a.yaml", "b.yaml", "--streams", "1", "--rounds", "2", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "B/A median of the rounds' ratios 1.320" in out and "B/A median of the rounds' ratios 1.091" in out
    assert "B/A over both start orders 1.200 (the server started second ran 1.100x as fast as the first)" in out
    assert not _FakeServer.started  # both stopped after each order
    # what B's worker chose, printed as each start order stops it; A (as llama-server) has no worker log
    assert out.count("B b.yaml chose at load: decode_threads auto: 2 threads to start") == 2
    assert out.count("B b.yaml chose while serving: decode_threads auto: one-row steps as served came every 8.00") == 2
    assert "A a.yaml chose" not in out
    assert ab_served.main(["a.yaml", "b.yaml", "--streams", "1", "--rounds", "2", "--dtype", "bfloat16",
                           "--one-order", "--b-property", "number_of_netty_threads=1"]) == 0
    out = capsys.readouterr().out
    assert "1.320" in out and "both start orders" not in out
    assert "1 stream(s), B b.yaml number_of_netty_threads=1: median" in out


def test_a_variants_torchserve_properties_reach_its_server_alone(tmp_path, monkeypatch, capsys):
    import pytest

    from scripts import tsctl

    monkeypatch.setattr(systems.TorchServeSystem, "build", lambda self: None)
    written = []

    def start_ready(self, timeout=300.0, **_):
        written.append(dict(self.props))
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(tsctl.TorchServe, "start_ready", start_ready)
    config = str(ab_served.ROOT / "model-config" / "bench-llama.yaml")
    serial = {"number_of_netty_threads": "1", "vmargs": "-Dlog4j.configurationFile=log4j2.xml -XX:+UseSerialGC"}
    for index, props in enumerate((None, serial)):
        with pytest.raises(RuntimeError, match="not started"):
            ab_served.make_system(config, index, tmp_path, "float32", 2, "bfloat16", props).start(10)
    default, varied = written
    assert "number_of_netty_threads" not in default and varied["number_of_netty_threads"] == "1"
    assert varied["vmargs"].startswith(f"-Dlog4j.configurationFile={ab_served.ROOT / 'log4j2.xml'} -XX:+UseSerialGC ")
    assert "-XX:TieredStopAtLevel=1" in default["vmargs"]
    assert varied["disable_token_authorization"] == "false" and varied["inference_address"].startswith("http://127.0.0.1:")
    with pytest.raises(SystemExit, match="TorchServe properties"):
        ab_served.make_system("llama-server", 0, tmp_path, "float32", 2, "bfloat16", {"number_of_netty_threads": "1"})
    with pytest.raises(SystemExit):
        ab_served.main(["a.yaml", "b.yaml", "--b-property", "number_of_netty_threads"])
    assert "'number_of_netty_threads': want KEY=VALUE" in capsys.readouterr().err


def test_a_revisions_build_finds_this_checkouts_llama_cpp_converter(tmp_path, monkeypatch):
    """``git archive`` exports no build/: without LLAMA_CPP_TREE a llamacpp config's build cannot convert."""
    import subprocess
    from types import SimpleNamespace

    calls = []

    def run(args, **kw):
        calls.append((args, kw))
        return SimpleNamespace(stdout=b"")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.delenv("LLAMA_CPP_TREE", raising=False)
    system = SimpleNamespace(config=tmp_path / "v.yaml", checkpoint=tmp_path / "ckpt", model_name="variant0",
                             work=tmp_path / "variant0", store=tmp_path / "store")
    ab_served.build_at_revision(system, "HEAD", tmp_path / "tree0")
    (build, kw), = [call for call in calls if str(call[0][1]).endswith("build_model.py")]
    assert kw["env"]["LLAMA_CPP_TREE"] == str(ab_served.ROOT / "build" / "peers" / "llama.cpp")
    assert kw["cwd"] == tmp_path / "tree0" and build[1] == str(tmp_path / "tree0" / "scripts" / "build_model.py")
    monkeypatch.setenv("LLAMA_CPP_TREE", "/opt/llama.cpp")  # the user's own tree wins
    ab_served.build_at_revision(system, "HEAD", tmp_path / "tree1")
    assert calls[-1][1]["env"]["LLAMA_CPP_TREE"] == "/opt/llama.cpp"
