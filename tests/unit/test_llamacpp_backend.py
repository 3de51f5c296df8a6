"""The llamacpp backend on the real llama.cpp (llama-cpp-python, built by `make llamacpp`), over a
GGUF of the tiny model made by the build step's own conversion.

Its logits are checked against the torch slot backend's on the same checkpoint (float32 both,
so they differ only by summation order), through every part of the slot interface: prefill,
chunked prefill, decode, mixed steps, freed and reused slots, a step split over several
``llama_decode`` calls, per-part failures and the rollback after a failed call.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from llama_engine.backends.base import PrefillChunk
from llama_engine.backends.llamacpp_backend import LlamaCppBackend, LlamaCppSlotBackend
from llama_engine.backends.torch_backend import TorchSlotBackend
from llama_engine.cpu_limits import UsableCpus
from scripts import build_model

MAX_LENGTH = 128
PROMPT = [1] + list(range(10, 50))


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float32 summation-order noise, relative to the logits' scale."""
    return (a - b).abs().max().item() <= 2e-3 * max(1.0, b.abs().max().item())


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tiny_model_dir):
    """The tiny checkpoint with ``model.gguf`` inside, as ``build_model.convert_to_gguf`` leaves it."""
    from llama_engine.config import HandlerConfig

    root = tmp_path_factory.mktemp("gguf")
    shutil.copytree(tiny_model_dir, root / "model")
    cfg = type("Cfg", (), {"handler": HandlerConfig(backend="llamacpp", gguf_type="f32")})()
    return build_model.convert_to_gguf(cfg, root)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return TorchSlotBackend.from_pretrained(str(tiny_model_dir), 4, MAX_LENGTH, "float32", "cpu")


@pytest.fixture()
def backend(tiny_gguf):
    made = LlamaCppSlotBackend(str(tiny_gguf), 4, MAX_LENGTH, threads=1)
    yield made
    made.close()


def test_conversion_keeps_the_tokenizer_and_drops_the_safetensors(tiny_gguf):
    folder = tiny_gguf.parent
    assert tiny_gguf.read_bytes()[:4] == b"GGUF"
    assert (folder / "tokenizer.json").exists() and (folder / "config.json").exists()
    assert not list(folder.glob("*.safetensors"))


def test_prefill_and_decode_match_torch(backend, reference):
    for slot in range(2):
        reference.free_slot(slot)
    assert close(backend.prefill_slot(0, PROMPT), reference.prefill_slot(0, PROMPT))
    assert close(backend.prefill_slot(1, PROMPT[:7]), reference.prefill_slot(1, PROMPT[:7]))
    assert close(backend.decode_slots([0, 1], [5, 9]), reference.decode_slots([0, 1], [5, 9]))
    assert [backend.slot_length(s) for s in range(3)] == [len(PROMPT) + 1, 8, 0]


def test_chunked_prefill_equals_one_prefill(backend):
    whole = backend.prefill_slot(0, PROMPT)
    backend.prefill_slot(1, PROMPT[:13])
    assert close(backend.prefill_slot(1, PROMPT[13:], start=13), whole)
    assert backend.slot_length(1) == len(PROMPT)


def test_one_step_of_rows_and_chunks_matches_torch(backend, reference):
    for slot in range(4):
        reference.free_slot(slot)
    for b in (backend, reference):
        b.prefill_slot(0, PROMPT)
        b.prefill_slot(1, PROMPT[:20])
    ours = backend.step_slots([0], [3], [PrefillChunk(1, PROMPT[20:], 20), PrefillChunk(2, PROMPT[:9])])
    theirs = reference.step_slots([0], [3], [PrefillChunk(1, PROMPT[20:], 20), PrefillChunk(2, PROMPT[:9])])
    assert close(ours.decode, theirs.decode)
    assert all(close(a, b) for a, b in zip(ours.prefills, theirs.prefills))


def test_a_freed_slot_forgets_its_sequence(backend):
    fresh = backend.prefill_slot(0, PROMPT)
    backend.decode_slots([0], [4])
    backend.free_slot(0)
    assert backend.slot_length(0) == 0
    assert close(backend.prefill_slot(0, PROMPT), fresh)


def test_a_step_longer_than_one_call_is_split_in_order(tiny_gguf, backend):
    small = LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=1, max_batch_tokens=8)
    try:
        assert close(small.prefill_slot(0, PROMPT), backend.prefill_slot(0, PROMPT))
        out = small.step_slots([0], [5], [PrefillChunk(1, PROMPT)])
        want = backend.step_slots([0], [5], [PrefillChunk(1, PROMPT)])
        assert close(out.decode, want.decode) and close(out.prefills[0], want.prefills[0])
    finally:
        small.close()


def test_a_bad_part_fails_alone(backend):
    backend.prefill_slot(0, PROMPT)
    out = backend.step_slots([0], [5], [PrefillChunk(3, PROMPT, start=4), PrefillChunk(1, PROMPT)])
    assert isinstance(out.prefills[0], ValueError) and "cannot prefill from 4" in str(out.prefills[0])
    assert out.prefills[1].shape == (backend.n_vocab,) and out.decode.shape == (1, backend.n_vocab)
    with pytest.raises(ValueError, match="empty slot"):
        backend.decode_slots([2], [1])
    with pytest.raises(ValueError, match="positions"):
        backend.prefill_slot(2, list(range(MAX_LENGTH + 1)))


def test_a_failed_call_rolls_the_slots_back(backend, monkeypatch):
    before = backend.prefill_slot(0, PROMPT)
    decode = backend.lib.llama_decode
    monkeypatch.setattr(backend.lib, "llama_decode", lambda ctx, batch: -1)
    out = backend.step_slots([0], [5], [PrefillChunk(1, PROMPT)])
    assert isinstance(out.decode, RuntimeError) and "invalid input batch" in str(out.decode)
    assert out.prefills[0] is out.decode
    monkeypatch.setattr(backend.lib, "llama_decode", decode)
    assert [backend.slot_length(s) for s in (0, 1)] == [len(PROMPT), 0]
    backend.free_slot(0)
    assert close(backend.prefill_slot(0, PROMPT), before)


def test_static_batches_drop_left_padding(tiny_gguf, backend):
    static = LlamaCppBackend(str(tiny_gguf), MAX_LENGTH, batch_size=2, threads=1)
    try:
        ids = torch.tensor([[0, 0, 0] + PROMPT[:10], PROMPT[:13]])
        mask = torch.tensor([[0, 0, 0] + [1] * 10, [1] * 13])
        logits = static.prefill(ids, mask)
        assert close(logits[0], backend.prefill_slot(0, PROMPT[:10]))
        assert close(logits[1], backend.prefill_slot(1, PROMPT[:13]))
        assert static.retain([1]) and static.decode(torch.tensor([7])).shape == (1, backend.n_vocab)
        grown = static.prefill(torch.tensor([PROMPT[:10]] * 3), torch.ones(3, 10, dtype=torch.long))
        assert static.slots.max_slots == 3 and all(close(row, logits[0]) for row in grown)
        with pytest.raises(RuntimeError, match="while some of its 3 are in use"):
            static.slots.reserve_slots(4)
    finally:
        static.slots.close()


def test_engine_generates_through_llama_cpp_as_through_torch(tiny_gguf, tiny_model_dir):
    from llama_engine import Engine
    from llama_engine.config import HandlerConfig
    from llama_engine.params import SamplingParams
    from llama_engine.request import GenerationRequest

    llama = Engine.from_config(HandlerConfig(backend="llamacpp", model_path="model", max_length=MAX_LENGTH),
                               str(tiny_gguf.parent.parent))
    torch_engine = Engine.from_config(HandlerConfig(model_path=tiny_model_dir.name, dtype="float32",
                                                    max_length=MAX_LENGTH), str(tiny_model_dir.parent))
    def greedy(engine):
        batch = [engine.prepare(GenerationRequest(p, SamplingParams(max_new_tokens=8)))
                 for p in ("The function returns", "Once upon a time")]
        return [r.token_ids for r in engine.generate(batch)]

    assert greedy(llama) == greedy(torch_engine)


@pytest.mark.parametrize("cpus", [2, 8])
def test_decode_threads_auto_tunes_one_row_steps_only_where_the_model_takes_every_cpu(tiny_gguf, monkeypatch,
                                                                                    caplog, cpus):
    import logging

    from llama_engine.backends import llamacpp_backend

    monkeypatch.setattr(llamacpp_backend, "usable_cpus", lambda: UsableCpus(cpus, "affinity"))
    with caplog.at_level(logging.INFO, logger=llamacpp_backend.logger.name):
        made = LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=2, decode_threads="auto")
    try:
        assert made.decode_threads == 2 and made.lib.llama_n_threads(made.ctx) == 2
        if cpus == 2:  # no CPU left for the frontend: steps of one row try 2 and 1 while serving
            assert made.step_threads.candidates == (2, 1)
            assert "decode_threads auto: 2 threads to start; steps of one row as served choose between 2 and 1" \
                in caplog.text
        else:
            assert made.step_threads is None and "decode_threads auto:" not in caplog.text
    finally:
        made.close()


class _StepClock:
    """A clock whose step of one row lasts ``costs[threads]`` for the backend's thread count of that step."""

    def __init__(self, backend, costs):
        self.backend, self.costs, self.now = backend, costs, 0.0

    def __call__(self):
        self.now += self.costs[self.backend.decode_threads]  # still the count of the step that just ran
        return self.now


@pytest.mark.parametrize("faster", [1, 2])
def test_one_row_steps_keep_the_thread_count_that_served_them_faster(tiny_gguf, monkeypatch, faster):
    from llama_engine.backends import llamacpp_backend

    monkeypatch.setattr(llamacpp_backend, "usable_cpus", lambda: UsableCpus(2, "affinity"))
    made = LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=2, decode_threads="auto")
    fixed = LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=2, decode_threads=2)
    try:
        tuner = made.step_threads
        tuner.clock = _StepClock(made, {faster: 8e-3, 3 - faster: 10e-3})
        trial = tuner.block * tuner.rounds * 2
        picks, expected, seen = [], [], []
        for backend, out in ((made, picks), (fixed, expected)):
            token = int(backend.prefill_slot(0, [1, 5, 9, 3]).argmax())
            backend.prefill_slot(1, [2, 4])
            backend.decode_slots([0, 1], [token, 7])  # two rows: not timed, and all threads
            for _ in range(trial + 3):
                token = int(backend.decode_slots([0], [token]).argmax())
                out.append(token)
                seen.append(backend.lib.llama_n_threads(backend.ctx))
        assert not tuner.trying and made.decode_threads == faster
        assert made.lib.llama_n_threads(made.ctx) == faster and made.lib.llama_n_threads_batch(made.ctx) == 2
        assert set(seen[:trial]) == {1, 2}, "the trial ran both counts"
        assert tuner.decisions[0][0] == faster
        assert tuner.decisions[0][1] == pytest.approx({faster: 8e-3, 3 - faster: 10e-3})
        assert picks == expected, "the thread count changed what a step computes"
    finally:
        made.close()
        fixed.close()


def test_decode_threads_set_is_kept_and_capped_at_the_threads(tiny_gguf):
    made = LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=2, decode_threads=1)
    capped = LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=1, decode_threads=4)
    try:
        assert made.lib.llama_n_threads(made.ctx) == 1 and made.lib.llama_n_threads_batch(made.ctx) == 2
        assert capped.decode_threads == 1
    finally:
        made.close()
        capped.close()


@pytest.mark.parametrize("flash_attn", ["on", "off"])
def test_flash_attention_either_way_matches_torch_and_reaches_every_context(tiny_gguf, reference, monkeypatch,
                                                                             flash_attn):
    made = LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=1, flash_attn=flash_attn)
    created = []
    new_context = made.lib.llama_init_from_model
    monkeypatch.setattr(made.lib, "llama_init_from_model",
                        lambda model, params: created.append(params.flash_attn_type) or new_context(model, params))
    try:
        for slot in range(2):
            reference.free_slot(slot)
        assert close(made.prefill_slot(0, PROMPT), reference.prefill_slot(0, PROMPT))
        assert close(made.decode_slots([0], [5]), reference.decode_slots([0], [5]))
        made.free_slot(0)
        made.reserve_slots(3)  # a new context keeps the setting
        assert created == [{"on": 1, "off": 0}[flash_attn]]
        assert close(made.prefill_slot(2, PROMPT[:9]), reference.prefill_slot(1, PROMPT[:9]))
    finally:
        made.close()


@pytest.mark.parametrize("costs,expected", [({"on": 2.0, "off": 1.0}, "off"), ({"on": 1.0, "off": 2.0}, "on")])
def test_flash_attn_auto_takes_the_setting_whose_request_took_less(tiny_gguf, monkeypatch, caplog, costs, expected):
    import logging

    from llama_engine.backends import llamacpp_backend

    made_with, timed = {}, []
    new_context = llamacpp_backend.LlamaCppSlotBackend._new_context

    def remember(self, slots, positions, flash_attn):
        ctx = new_context(self, slots, positions, flash_attn)
        made_with[ctx] = (flash_attn, slots, positions)
        return ctx

    def request_costs(self, contexts, tokens):
        timed.append(({name: made_with[ctx] for name, ctx in contexts.items()}, tokens))
        return costs

    monkeypatch.setattr(llamacpp_backend.LlamaCppSlotBackend, "_new_context", remember)
    monkeypatch.setattr(llamacpp_backend.LlamaCppSlotBackend, "_request_costs", request_costs)
    with caplog.at_level(logging.INFO, logger=llamacpp_backend.logger.name):
        made = LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=1)
    try:
        assert made.flash_attn == expected
        assert made_with[made.ctx] == (expected, 2, MAX_LENGTH)
        # one small context of every slot per setting (256 positions each, llama.cpp's least), on a
        # prompt of half of max_length (under 256 tokens)
        tokens = MAX_LENGTH // 2
        assert timed == [({"on": ("on", 2, 256), "off": ("off", 2, 256)}, tokens)]
        assert f"flash attention on, {1e3 * costs['off']:.0f} ms off; {expected}" in caplog.text
    finally:
        made.close()


STEP_ALONE, STEP_TOGETHER = {"on": 0.001, "off": 0.002}, {"on": 0.02, "off": 0.005}


@pytest.mark.parametrize("slots,expected", [(1, "on"), (3, "off")])
def test_flash_attn_auto_weighs_a_step_of_every_slot_beside_a_request_alone(tiny_gguf, monkeypatch, slots, expected):
    """On a clock that each real ``llama_decode`` advances by a set cost: flash attention's steps are
    cheaper alone and dearer with every slot busy, so it wins only where one slot is all there is."""
    from llama_engine.backends import llamacpp_backend

    clock, setting_of, calls = [0.0], {}, []
    new_context, decode = LlamaCppSlotBackend._new_context, LlamaCppSlotBackend._decode

    def remember(self, slots_, positions, flash_attn):
        ctx = new_context(self, slots_, positions, flash_attn)
        setting_of[ctx] = flash_attn
        return ctx

    def costed(self, entries, ctx=None):
        out = decode(self, entries, ctx)  # the real call: llama.cpp checks each sequence's positions
        setting = setting_of.get(ctx)
        if setting is not None:
            calls.append((setting, [(pos, seq) for _, pos, seq, _ in entries]))
            rows = len(entries)
            clock[0] += 0.05 if rows > slots else (STEP_ALONE if rows == 1 else STEP_TOGETHER)[setting]
        return out

    monkeypatch.setattr(LlamaCppSlotBackend, "_new_context", remember)
    monkeypatch.setattr(LlamaCppSlotBackend, "_decode", costed)
    monkeypatch.setattr(llamacpp_backend, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    made = LlamaCppSlotBackend(str(tiny_gguf), slots, MAX_LENGTH, threads=1)
    try:
        assert made.flash_attn == expected
        tokens = MAX_LENGTH // 2
        steps = [entries for setting, entries in calls if setting == "on"][1:]
        assert len(steps) == (12 if slots > 1 else 6)
        # every sequence of the wave steps on from the prompt copied into it, one position at a time
        # (sequence 0 also takes the steps alone, one before each of these)
        together = [entries for entries in steps if len(entries) > 1]
        assert together == [[(tokens + 2 * i + 1, 0)] + [(tokens + i, seq) for seq in range(1, slots)]
                            for i in range(6 if slots > 1 else 0)]
    finally:
        made.close()


def test_flash_attn_auto_times_a_real_request_and_leaves_llama_cpps_choice_under_64_positions(tiny_gguf):
    timed = LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=1)
    short = LlamaCppSlotBackend(str(tiny_gguf), 2, 48, threads=1)
    try:
        assert timed.flash_attn in ("on", "off") and short.flash_attn == "auto"
        assert [timed.slot_length(s) for s in range(2)] == [0, 0]
        assert timed.prefill_slot(0, PROMPT).shape[-1] == timed.n_vocab
    finally:
        timed.close()
        short.close()
    with pytest.raises(ValueError, match="flash_attn must be one of auto, off, on, got 'yes'"):
        LlamaCppSlotBackend(str(tiny_gguf), 2, MAX_LENGTH, threads=1, flash_attn="yes")


def test_missing_pieces_say_what_to_run(tiny_gguf, tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="make build"):
        LlamaCppSlotBackend(str(tmp_path / "absent.gguf"), 1, MAX_LENGTH)
    with pytest.raises(ValueError, match="trained context"):
        LlamaCppSlotBackend(str(tiny_gguf), 1, 10**6)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(RuntimeError, match="make llamacpp"):
        LlamaCppSlotBackend(str(tiny_gguf), 1, MAX_LENGTH)


#: Runs in a child process: on an AMX CPU, a llama.cpp built without the tile-config patch
#: (scripts/build_peers.sh) dies with SIGSEGV on its first q8_0 product, which would take the
#: test session with it.
GENERATE_PROBE = """
import json, sys
from llama_engine.backends.llamacpp_backend import LlamaCppSlotBackend
backend = LlamaCppSlotBackend(sys.argv[1], 2, 128, threads=1)
logits = [backend.prefill_slot(0, json.loads(sys.argv[2]))]
logits += backend.decode_slots([0], [int(logits[0].argmax())])
print(json.dumps([row.tolist() for row in logits]))
"""


def test_a_q8_0_gguf_generates_close_to_float32(tmp_path, tiny_model_dir, reference):
    """q8_0 is the type ggml's AMX kernels compute: on an AMX CPU this exercises them."""
    from llama_engine.config import HandlerConfig

    shutil.copytree(tiny_model_dir, tmp_path / "model")
    cfg = type("Cfg", (), {"handler": HandlerConfig(backend="llamacpp", gguf_type="q8_0")})()
    gguf = build_model.convert_to_gguf(cfg, tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (build_model.ROOT / "handlers", build_model.ROOT)))
    run = subprocess.run([sys.executable, "-c", GENERATE_PROBE, str(gguf), json.dumps(PROMPT)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    got = torch.tensor(json.loads(run.stdout.strip().splitlines()[-1]))
    reference.free_slot(0)
    want = [reference.prefill_slot(0, PROMPT)]
    want.append(reference.decode_slots([0], [int(got[0].argmax())])[0])
    for g, w in zip(got, want):
        assert torch.nn.functional.cosine_similarity(g, w, dim=0) > 0.99


def test_a_bf16_checkpoint_converts_to_this_cpus_16_bit_type_and_generates_as_torch(tmp_path, tiny_model_dir, capsys):
    """``gguf_type: auto`` on a bf16 checkpoint: f16 on a CPU without native bf16 (ggml's faster type
    there), bf16 on one with it; either way the weights are the checkpoint's, exactly."""
    from safetensors.torch import load_file, save_file

    from llama_engine.config import HandlerConfig
    from llama_engine.cpu import gguf_16_bit_type

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    save_file({name: t.bfloat16() for name, t in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, torch_dtype="bfloat16")))
    reference = TorchSlotBackend.from_pretrained(str(folder), 2, MAX_LENGTH, "float32", "cpu")
    cfg = type("Cfg", (), {"handler": HandlerConfig(backend="llamacpp", gguf_type="auto")})()
    gguf = build_model.convert_to_gguf(cfg, tmp_path)
    assert f"(--outtype {gguf_16_bit_type()})" in capsys.readouterr().out
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (build_model.ROOT / "handlers", build_model.ROOT)))
    run = subprocess.run([sys.executable, "-c", GENERATE_PROBE, str(gguf), json.dumps(PROMPT)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, f"exit {run.returncode}: {run.stderr[-2000:]}"
    got = torch.tensor(json.loads(run.stdout.strip().splitlines()[-1]))
    want = [reference.prefill_slot(0, PROMPT)]
    want.append(reference.decode_slots([0], [int(got[0].argmax())])[0])
    for g, w in zip(got, want):
        assert torch.nn.functional.cosine_similarity(g, w, dim=0) > 0.999
        assert int(g.argmax()) == int(w.argmax())
