"""scripts.bench.peer_flags: llama-server's -fa timed both ways, and the peer run with the faster."""
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

    def with_flash_attn(self, setting, work):
        return _Twin(setting, work, self.log)


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
    twin = peer.with_flash_attn("off", tmp_path / "other")
    twin.binary, twin.port = "llama-server", 2
    assert twin.command()[-2:] == ["-fa", "off"] and twin.work == tmp_path / "other"
    twin.timings["x"] = 1.0
    assert peer.timings == {} and peer.flash_attn == "auto" and peer.work == tmp_path / "llama.cpp"


def test_ab_served_reads_llama_server_options(tmp_path, monkeypatch):
    monkeypatch.setattr(LlamaCppSystem, "detect", lambda self: (True, "stub: not started"))
    peer = ab_served.make_system("llama-server:t1:fa-off", 0, tmp_path, "bfloat16", 2, "bfloat16")
    assert peer.decode_threads == 1 and peer.flash_attn == "off"
    assert ab_served.make_system("llama-server:fa-on", 1, tmp_path, "bfloat16", 2, "bfloat16").flash_attn == "on"
    with pytest.raises(SystemExit, match="unknown llama-server option 'fast'"):
        ab_served.make_system("llama-server:fast", 0, tmp_path, "bfloat16", 2, "bfloat16")
