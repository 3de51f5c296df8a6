"""scripts.bench.peer_flags: llama-server's -fa and GGUF type timed both ways, and the peer run with the faster."""
from pathlib import Path

import pytest

from scripts.bench import ab_served, peer_flags, scenarios
from scripts.bench.systems import LlamaCppSystem


class _Record(float):
    """A request's output tok/s, as the fake ``summarize`` reads it."""

    ok = True

    def decode_tokens_per_s(self) -> float:
        return float(self)


class _Prompts:
    warm = "warm"
    waves = {(1, 0): ["p"], (8, 0): ["p"] * 8}


class _Twin:
    def __init__(self, setting: str, work: Path, log: list):
        self.setting, self.work, self.log = setting, work, log

    def start(self, timeout):
        self.log.append(("start", self.setting, self.work.name))
        return self.setting

    def stop(self):
        self.log.append(("stop", self.setting))


class _Peer:
    name = "llama.cpp"
    flash_attn = "auto"

    def __init__(self, work: Path):
        self.work, self.log = work, []

    def twin(self, work, flash_attn=None, gguf=None):
        return _Twin(flash_attn or Path(gguf).stem.rsplit("-", 1)[-1], work, self.log)


PLAN = {"paired_concurrency": [1, 8], "paired_rounds": 3, "conc_output": 16, "conc_input": 32}


@pytest.mark.parametrize("speeds,choice", [
    ({"auto": 40.0, "off": 48.0}, "off"),
    ({"auto": 50.0, "off": 45.0}, "auto"),
    ({"auto": 50.0, "off": 50.0}, "auto"),  # a tie keeps llama-server's default
])
def test_the_peer_runs_with_the_setting_that_served_more(tmp_path, monkeypatch, speeds, choice):
    monkeypatch.setattr(scenarios, "summarize", lambda records, **labels: {
        "output_tokens_per_s": sum(records) / len(records) if records else None, **labels})
    waves = []

    def run_wave(adapter, prompts, tokens):
        waves.append((adapter, len(prompts), tokens))
        return [_Record(speeds[adapter])] * len(prompts)

    monitor = type("Monitor", (), {"snapshot": lambda self: None, "since": lambda self, snap: {}})()
    peer = _Peer(tmp_path / "llama.cpp")
    lines = []
    out = peer_flags.choose_flash_attn(peer, _Prompts(), PLAN, monitor, run_wave, lines.append)
    assert peer.flash_attn == choice and out["choice"] == choice
    assert out["off_over_auto"] == pytest.approx(speeds["off"] / speeds["auto"], rel=1e-3)
    assert out["medians"] == {"1": round(speeds["off"] / speeds["auto"], 4), "8": round(speeds["off"] / speeds["auto"], 4)}
    assert all(len(r) == 2 for r in out["rounds"].values())
    # both up at once in their own folders, warmed, then waves alternated (2 rounds, not the plan's 3); both stopped
    assert peer.log[:2] == [("start", "auto", "llama.cpp-fa-auto"), ("start", "off", "llama.cpp-fa-off")]
    assert sorted(peer.log[2:]) == [("stop", "auto"), ("stop", "off")]
    timed = [(a, n) for a, n, tokens in waves if tokens == 16]
    assert timed == [("auto", 1), ("off", 1), ("off", 1), ("auto", 1), ("auto", 8), ("off", 8), ("off", 8), ("auto", 8)]
    assert f"runs with -fa {choice}" in lines[-1]


def test_both_servers_stop_when_a_wave_fails(tmp_path, monkeypatch):
    def run_wave(adapter, prompts, tokens):
        if tokens != 4:
            raise ConnectionError("peer died")
        return [1.0]

    monitor = type("Monitor", (), {"snapshot": lambda self: None, "since": lambda self, snap: {}})()
    peer = _Peer(tmp_path / "llama.cpp")
    with pytest.raises(ConnectionError):
        peer_flags.choose_flash_attn(peer, _Prompts(), PLAN, monitor, run_wave, print)
    assert sorted(e for e in peer.log if e[0] == "stop") == [("stop", "auto"), ("stop", "off")]
    assert peer.flash_attn == "auto"


def test_no_completed_wave_is_an_error_not_a_choice():
    with pytest.raises(RuntimeError, match="no wave completed on both -fa settings"):
        peer_flags.decide(_Peer(Path("w")), [{"system": "off", "concurrency": 1, "off_over_auto_median": None}], print)


def test_llama_server_takes_fa_and_a_twin_is_a_separate_server(tmp_path):
    peer = LlamaCppSystem(tmp_path / "llama.cpp", "bfloat16", 2, 8, 1024, gguf=tmp_path / "m.gguf")
    peer.binary, peer.port = "llama-server", 1
    assert peer.command()[-2:] == ["-fa", "auto"]
    twin = peer.twin(tmp_path / "other", flash_attn="off")
    twin.binary, twin.port = "llama-server", 2
    assert twin.command()[-2:] == ["-fa", "off"] and twin.work == tmp_path / "other"
    twin.timings["x"] = 1.0
    assert peer.timings == {} and peer.flash_attn == "auto" and peer.work == tmp_path / "llama.cpp"
    typed = peer.twin(tmp_path / "typed", gguf=str(tmp_path / "f16.gguf"))
    typed.port = 3
    assert typed.command()[2] == str(tmp_path / "f16.gguf") and peer.command()[2] == str(tmp_path / "m.gguf")
    with pytest.raises(TypeError, match="not \\['threads'\\]"):
        peer.twin(tmp_path / "x", threads=4)


@pytest.mark.parametrize("default, speeds, choice", [
    ("bf16", {"bf16": 40.0, "f16": 48.0}, "f16"),
    ("f16", {"bf16": 40.0, "f16": 48.0}, "f16"),
    ("f16", {"bf16": 50.0, "f16": 45.0}, "bf16"),
    ("f16", {"bf16": 50.0, "f16": 50.0}, "f16"),  # a tie keeps the type gguf_type: auto gives the backend
])
def test_the_peer_runs_on_the_16_bit_gguf_that_served_more(tmp_path, monkeypatch, default, speeds, choice):
    monkeypatch.setattr(scenarios, "summarize", lambda records, **labels: {
        "output_tokens_per_s": sum(records) / len(records) if records else None, **labels})
    monitor = type("Monitor", (), {"snapshot": lambda self: None, "since": lambda self, snap: {}})()
    peer = _Peer(tmp_path / "llama.cpp")
    peer.gguf = tmp_path / f"bench-model-{default}.gguf"
    lines = []
    out = peer_flags.choose_gguf(peer, default, _Prompts(), PLAN, monitor,
                                 lambda adapter, prompts, tokens: [_Record(speeds[adapter])] * len(prompts), lines.append)
    other = "f16" if default == "bf16" else "bf16"
    assert out["choice"] == choice and peer.gguf == tmp_path / f"bench-model-{choice}.gguf"
    assert out[f"{other}_over_{default}"] == pytest.approx(speeds[other] / speeds[default], rel=1e-3)
    assert set(out["medians"]) == {"1", "8"} and all(len(r) == 2 for r in out["rounds"].values())
    assert peer.log[:2] == [("start", default, f"llama.cpp-{default}"), ("start", other, f"llama.cpp-{other}")]
    assert sorted(peer.log[2:]) == sorted([("stop", default), ("stop", other)])
    assert lines[-1].endswith(f"runs on bench-model-{choice}.gguf")


def test_ab_served_reads_llama_server_options(tmp_path, monkeypatch):
    monkeypatch.setattr(LlamaCppSystem, "detect", lambda self: (True, "stub: not started"))
    peer = ab_served.make_system("llama-server:t1:fa-off", 0, tmp_path, "bfloat16", 2, "bfloat16")
    assert peer.decode_threads == 1 and peer.flash_attn == "off"
    assert ab_served.make_system("llama-server:fa-on", 1, tmp_path, "bfloat16", 2, "bfloat16").flash_attn == "on"
    typed = ab_served.make_system("llama-server:fa-off:f16", 1, tmp_path, "bfloat16", 2, "bfloat16")
    assert typed.gguf.name == "bench-model-f16.gguf" and typed.flash_attn == "off"
    assert ab_served.make_system("llama-server:q8_0", 1, tmp_path, "bfloat16", 2, "bfloat16").gguf.name == \
        "bench-model-q8_0.gguf"
    with pytest.raises(SystemExit, match="unknown llama-server option 'fast'"):
        ab_served.make_system("llama-server:fast", 0, tmp_path, "bfloat16", 2, "bfloat16")


class _Budget:
    def ok(self, what, need=0.0):
        return True


def _bench_run(tmp_path, weight_dtype="bfloat16", llama_gguf=None):
    from types import SimpleNamespace

    return SimpleNamespace(weight_dtype=weight_dtype, args=SimpleNamespace(llama_gguf=llama_gguf),
                           plan={"scenarios": ["paired"], "paired_rounds": 3}, budget=_Budget(), prompts=_Prompts(),
                           monitor=None, timeout=60, phases={})


@pytest.mark.parametrize("native_bf16, default", [(False, "f16"), (True, "bf16")])
def test_the_bench_times_the_peers_16_bit_gguf_from_the_type_the_backend_gets(tmp_path, monkeypatch, native_bf16,
                                                                              default):
    from llama_engine import cpu
    from scripts.bench.run import BenchRun

    monkeypatch.setattr(cpu, "host_cpu_flags", lambda: frozenset({"avx2", "f16c"} | ({"avx512_bf16"} if native_bf16 else set())))
    monkeypatch.delenv(cpu.CLASS_ENV, raising=False)
    other = "bf16" if default == "f16" else "f16"
    for kind in (default, other):
        (tmp_path / f"bench-model-{kind}.gguf").write_bytes(b"GGUF")
    peer = LlamaCppSystem(tmp_path / "llama.cpp", "bfloat16", 2, 8, 1024, gguf=tmp_path / f"bench-model-{default}.gguf")
    peer.binary = "llama-server"
    asked = []

    def choose(peer, default, *args):
        asked.append(default)
        peer.gguf = peer.gguf.with_name(f"bench-model-{other}.gguf")
        return {"choice": other, "file": peer.gguf.name, f"{other}_over_{default}": 1.06, "medians": {"1": 1.1, "8": 1.02}}

    monkeypatch.setattr(peer_flags, "choose_gguf", choose)
    status = {"detail": "found"}
    BenchRun._peer_gguf(_bench_run(tmp_path), peer, status)
    assert asked == [default] and peer.gguf.name == f"bench-model-{other}.gguf"
    assert f"{other} / {default} 1.06, at 1 streams 1.10, 8 streams 1.02" in status["detail"]

    (tmp_path / f"bench-model-{other}.gguf").unlink()  # the other file missing: the default, said why
    peer.gguf = tmp_path / f"bench-model-{default}.gguf"
    status = {"detail": "found"}
    BenchRun._peer_gguf(_bench_run(tmp_path), peer, status)
    assert status["gguf"]["choice"] == default and asked == [default]
    assert f"not timed: no {tmp_path / f'bench-model-{other}.gguf'} (make bench-peers BENCH_PEERS=gguf)" in status["detail"]


def test_a_given_or_float32_gguf_is_not_timed(tmp_path, monkeypatch):
    from scripts.bench.run import BenchRun

    monkeypatch.setattr(peer_flags, "choose_gguf", lambda *a: pytest.fail("timed"))
    peer = LlamaCppSystem(tmp_path / "llama.cpp", "bfloat16", 2, 8, 1024, gguf=tmp_path / "m.gguf")
    for run in (_bench_run(tmp_path, "float32"), _bench_run(tmp_path, llama_gguf=tmp_path / "m.gguf")):
        status = {"detail": "found"}
        BenchRun._peer_gguf(run, peer, status)
        assert status == {"detail": "found"}
