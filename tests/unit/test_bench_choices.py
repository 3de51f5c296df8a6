"""The bench records what each process chose at load (scripts/bench/choices.py) and prints it on its page."""
from __future__ import annotations

import logging

from scripts.bench import report
from scripts.bench.choices import ChoiceRecorder, choices_in_log

WORKER_LOG = """\
2026-11-29T16:43:01,101 [INFO ] W-9000-bench_1.0-stdout MODEL_LOG - Backend worker started
2026-11-29T16:43:05,202 [INFO ] W-9000-bench_1.0-stdout MODEL_LOG - bf16 prompt products, 2 threads, 256 rows: \
oneDNN bf16 119.8 ms, float32 over a copy 86.8 ms (0.71 of bf16's), native GEMM 87.0 ms (0.77 of bf16's) \
(medians of 5 rounds) -> float32
2026-11-29T16:43:05,303 [INFO ] W-9000-bench_1.0-stdout MODEL_LOG - packed 2 linear layers (torch.bfloat16)
2026-11-29T16:43:06,404 [INFO ] W-9000-bench_1.0-stdout MODEL_LOG - prompt attention, torch.bfloat16 over a \
torch.bfloat16 cache, 512 tokens, 2 threads: native 2.78 ms, torch 5.79 ms (best) -> native
2026-11-29T16:43:07,505 [INFO ] W-9000-bench_1.0-stdout MODEL_LOG - model ready in 4.6 s
"""


def test_a_workers_decisions_are_read_from_its_log_without_torchserves_prefixes():
    assert choices_in_log(WORKER_LOG) == [
        "bf16 prompt products, 2 threads, 256 rows: oneDNN bf16 119.8 ms, float32 over a copy 86.8 ms (0.71 of "
        "bf16's), native GEMM 87.0 ms (0.77 of bf16's) (medians of 5 rounds) -> float32",
        "prompt attention, torch.bfloat16 over a torch.bfloat16 cache, 512 tokens, 2 threads: native 2.78 ms, "
        "torch 5.79 ms (best) -> native"]
    assert choices_in_log("") == []


SERVED_LLAMACPP_LOG = "".join(
    f"2026-12-03T23:{minute:02d}:00,000 [INFO ] W-9001-bench_1.0-stdout MODEL_LOG - {line}\n" for minute, line in enumerate([
        "flash_attn auto: a request of 256 prompt tokens and 128 new ones alone took 900 ms with flash attention "
        "on, 950 ms off; on",
        "decode_threads auto: 2 threads to start; steps of one row as served choose between 2 and 1",
        "llama.cpp backend: model.gguf, 8 slots x 1024 positions, 2 threads (2 for one token)",
        "decode_threads auto: one-row steps as served came every 8.50 ms on 2 threads, 9.60 ms on 1 thread "
        "(medians of 18); 2 for one token"]))


def test_decisions_made_while_serving_are_told_apart_from_those_made_at_load():
    assert choices_in_log(SERVED_LLAMACPP_LOG) == [
        "flash_attn auto: a request of 256 prompt tokens and 128 new ones alone took 900 ms with flash attention "
        "on, 950 ms off; on",
        "decode_threads auto: 2 threads to start; steps of one row as served choose between 2 and 1"]
    assert choices_in_log(SERVED_LLAMACPP_LOG, serving=True) == [
        "decode_threads auto: one-row steps as served came every 8.50 ms on 2 threads, 9.60 ms on 1 thread "
        "(medians of 18); 2 for one token"]


def test_this_process_keeps_the_engines_decisions_while_recording_and_leaves_its_logger_as_it_was():
    engine = logging.getLogger("llama_engine")
    before = engine.level
    inner = logging.getLogger("llama_engine.backends.fast_linear")
    with ChoiceRecorder() as recorder:
        inner.info("bf16 weights in pair panels, %d threads: plain %.2f ms, pairs %.2f ms -> %s", 2, 4.48, 3.65,
                   "pairs")
        inner.info("packed %d linear layers", 2)  # not a decision
        logging.getLogger("elsewhere").warning("prompt attention, not the engine's")
    inner.info("float32 linears, 2 threads -> native")  # after it: not kept
    assert recorder.lines == ["bf16 weights in pair panels, 2 threads: plain 4.48 ms, pairs 3.65 ms -> pairs"]
    assert engine.level == before and recorder not in engine.handlers


def test_the_engines_warnings_still_reach_stderr_while_recording(capsys, monkeypatch):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # the bench configures no logging
    with ChoiceRecorder():
        logging.getLogger("llama_engine.backends.torch_backend").warning("the native kernels did not load")
        logging.getLogger("llama_engine").info("packed 2 linear layers")
    assert capsys.readouterr().err == "the native kernels did not load\n"


def test_the_page_lists_each_processes_choices_the_bench_process_first():
    results = {"extra": {"load_choices": {"torchserve": choices_in_log(WORKER_LOG), "torchserve-llamacpp": [],
                                          "bench process": ["bf16 prompt products, 2 threads -> native"]}}}
    text = report.load_choices_text(results)
    assert text.index("* bench process:") < text.index("* torchserve:") < text.index("* torchserve-llamacpp:")
    assert "\n  * `bf16 prompt products, 2 threads -> native`" in text
    assert "(medians of 5 rounds) -> float32`" in text and "* torchserve-llamacpp: nothing timed" in text
    assert report.load_choices_text({"extra": {}}) == ""


def test_the_page_lists_a_workers_choices_while_serving_under_its_load_time_ones_the_last_three():
    decisions = [f"decode_threads auto: one-row steps as served came every ...; {n} for one token" for n in (2, 1, 2, 2)]
    results = {"extra": {"load_choices": {"torchserve-llamacpp": choices_in_log(SERVED_LLAMACPP_LOG), "torchserve": []},
                         "serving_choices": {"torchserve-llamacpp": decisions}}}
    text = report.load_choices_text(results)
    worker = text[text.index("* torchserve-llamacpp:"):]
    assert worker.index("`decode_threads auto: 2 threads to start") < worker.index("* while serving (the last 3 of 4):")
    assert "\n    * `decode_threads auto: one-row steps as served came every ...; 1 for one token`" in worker
    assert worker.count("one-row steps as served") == 3 and "* torchserve: nothing timed" in text
    results["extra"]["serving_choices"]["torchserve-llamacpp"] = decisions[:1]
    assert "* while serving (1):" in report.load_choices_text(results)
