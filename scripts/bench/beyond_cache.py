"""Decode of a model larger than the CPU's last-level cache, against the memory bandwidth and llama-server.

The bench model's 230 MB of weights a token fit some CPUs' last-level cache (an Emerald Rapids
Xeon VM reports 260 MiB), so there its batch-1 decode efficiency reads weights partly from the
cache and says little of a 7B model. This builds a random-weight Llama of Llama-2's layer shape
(hidden 2048, 16 heads of 128) with enough layers for ``--times`` the cache's bytes, offline and
deterministically, and decodes one stream, then eight at once (``--streams``), on each system:

* ``torch``, ``llamacpp``: the engine in this process on either backend (the torch one as
  ``handler.dtype: auto`` serves it here; llama.cpp over the GGUF ``gguf_type: auto`` converts,
  where llama-cpp-python is installed);
* ``torchserve``: the handler on the torch backend, built into an archive and served by
  TorchServe with micro-batching, as the bench's ``torchserve`` row;
* ``torchserve-llamacpp``: the handler on the llamacpp backend over that GGUF, continuous
  batching, as the bench's row of that name (where llama-cpp-python is installed);
* ``llama-server``: llama.cpp's own server on that GGUF (where ``make bench-peers`` built it;
  under ``--cpu-class``, its build for that class).

Rounds alternate the systems, each wave bracketed by a memory-bandwidth sample; efficiency =
decode steps/s x weight bytes a token / the bracket's mean bandwidth (one stream: its tokens/s;
eight: a step of eight rows reads the weights once), and each system's decode and output tokens/s
over llama-server's. Prints figures, asserts none::

    python -m scripts.bench.beyond_cache                      # ~12 min on 2 cores, 1.1 GB of weights
    python -m scripts.bench.beyond_cache --cpu-class avx2     # as an AVX2-only CPU would compute
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT, ROOT / "handlers"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

#: Llama-2's layer shape at a smaller width (7B: hidden 4096, 32 heads of 128, intermediate 11008).
HIDDEN, INTERMEDIATE, HEADS = 2048, 5632, 16
#: Used where sysfs gives no last-level cache size: a 2-vCPU cloud VM's slice is at most this.
UNKNOWN_CACHE_BYTES = 64 << 20
#: The bench configs' ``handler.max_length`` (and the model's positions).
MAX_LENGTH = 1024
BACKEND_CONFIGS = {"torch": "model-config/bench-llama.yaml", "llamacpp": "model-config/bench-llama-llamacpp.yaml"}
#: What ``--backends`` takes: the two backends in this process, the handler served on each, and llama.cpp's own server.
BACKENDS = (*BACKEND_CONFIGS, "torchserve", "torchserve-llamacpp", "llama-server")
#: The systems that run llama-cpp-python (built for this host: no ``--cpu-class`` narrows it).
ON_LLAMA_CPP_PYTHON = ("llamacpp", "torchserve-llamacpp")
#: The systems that read the checkpoint's GGUF.
ON_GGUF = (*ON_LLAMA_CPP_PYTHON, "llama-server")


def layer_bytes(hidden: int, intermediate: int, width: int = 2) -> int:
    """Bytes of one decoder layer's linear weights (four attention projections, three MLP ones)."""
    return (4 * hidden * hidden + 3 * hidden * intermediate) * width


def layers_for(cache_bytes: int, times: float, hidden: int, intermediate: int) -> int:
    """Layers whose bf16 weights are at least ``times`` the cache."""
    return max(1, math.ceil(times * cache_bytes / layer_bytes(hidden, intermediate)))


def model_spec(args, cache_bytes: int):
    from scripts.bench.model import ModelSpec

    layers = args.layers or layers_for(cache_bytes, args.times, args.hidden, args.intermediate)
    return ModelSpec(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=layers,
                     num_attention_heads=args.heads, num_key_value_heads=args.heads)


def gguf_copy(checkpoint: Path, out: Path) -> tuple:
    """``out``: the checkpoint's config and tokenizer with ``model.gguf`` of the type ``gguf_type: auto``
    converts it to here (built once for each checkpoint, as its spec file says); returns (out, the GGUF type)."""
    from scripts.bench.model import SPEC_FILE
    from scripts.build_model import gguf_outtype, run_converter

    outtype = gguf_outtype("auto", checkpoint)
    out = out.with_name(f"{out.name}-{outtype}")
    spec = (checkpoint / SPEC_FILE).read_text()
    if (out / "model.gguf").is_file() and (out / SPEC_FILE).is_file() and (out / SPEC_FILE).read_text() == spec:
        return out, outtype
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in checkpoint.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors"):
            shutil.copy2(path, out / path.name)
    run_converter(checkpoint, out / "model.gguf", outtype)
    return out, outtype


def gguf_weight_dtype(outtype: str) -> str:
    """The torch dtype a GGUF of ``outtype`` stores its weights in (for the bytes a token)."""
    from scripts.build_model import GGUF_OF_16_BIT

    return {gguf: dtype for dtype, gguf in GGUF_OF_16_BIT.items()}.get(outtype, "float32")


class Server:
    """A server under test, one wave of streams at a time through the bench's client (``run_wave``)."""

    system = adapter = None

    def run_wave(self, prompts, max_new_tokens: int):
        from scripts.streaming_client import run_wave

        return run_wave(self.adapter, prompts, max_new_tokens, 600)

    def close(self) -> None:
        self.system.stop()


class LlamaServer(Server):
    """llama.cpp's ``llama-server`` (the bench's peer, built by ``make bench-peers``; under ``--cpu-class``
    the build for that class) on the GGUF, a slot for each stream."""

    def __init__(self, gguf: Path, work: Path, threads: int, parallel: int, cpu_class):
        from scripts.bench.systems import LlamaCppSystem

        self.system = LlamaCppSystem(work / "llama-server", "bfloat16", threads, parallel=parallel, max_length=MAX_LENGTH,
                                     gguf=gguf, cpu_class=cpu_class)
        installed, self.detail = self.system.detect()
        self.adapter = self.system.start(300) if installed else None
        self.load_s = self.system.timings.get("start_to_ready_s", 0.0)


class TorchServeModel(Server):
    """The handler served by TorchServe (``config``: the bench's ``torchserve`` row, the torch backend with
    micro-batching, or its ``torchserve-llamacpp`` row, llama.cpp with continuous batching), built into an
    archive of the checkpoint as ``make build`` builds one."""

    def __init__(self, name: str, config: Path, checkpoint: Path, work: Path):
        from scripts.bench.choices import choices_in_log
        from scripts.bench.systems import TorchServeSystem

        self.system = TorchServeSystem(work / name, config, checkpoint, model_name=f"beyond-cache-{name}")
        self.system.build()
        self.adapter = self.system.start(900)
        self.load_s = self.system.timings["start_to_ready_s"]
        #: what the worker chose at load (llamacpp: its decode threads), as the bench logs it
        self.choices = choices_in_log(self.system.server.model_log())
        for line in self.choices:
            print(f"{name} chose at load: {line}", flush=True)


def load_backends(args, checkpoint: Path, work: Path, loaded: dict) -> dict:
    """Into ``loaded`` (the caller closes what it holds): ``{name: (engine, weight bytes a token, what it
    runs)}`` for each available backend asked for."""
    from llama_engine.cpu import auto_dtype
    from scripts.bench import model as bench_model

    dtype = auto_dtype("cpu")
    gguf = None  # (its directory, its type): converted (or found) once for every system that reads it
    for name in args.backends:
        source, overrides = checkpoint, {"max_new_tokens": args.tokens}
        if name in ON_LLAMA_CPP_PYTHON and args.cpu_class:
            print(f"{name}: skipped, llama-cpp-python is built for this host's instruction set, which no variable "
                  f"narrows to class {args.cpu_class}'s", flush=True)
            continue
        if name in ON_LLAMA_CPP_PYTHON and importlib.util.find_spec("llama_cpp") is None:
            print(f"{name}: llama-cpp-python is not installed (make llamacpp); skipped", flush=True)
            continue
        if name in ON_GGUF:
            gguf = gguf or gguf_copy(checkpoint, args.root / "gguf")
            source, outtype = gguf
            weight_dtype = gguf_weight_dtype(outtype)
        if name == "llama-server":
            engine = LlamaServer(source / "model.gguf", work, args.threads, max(args.streams), args.cpu_class)
            if engine.adapter is None:
                print(f"llama-server: skipped, {engine.detail} (make bench-peers)", flush=True)
                continue
            what = f"llama-server over a {outtype} GGUF ({engine.system.binary})"
        elif name == "llamacpp":
            overrides["gguf_type"] = outtype
            engine = in_process(name, dtype, args, work, source, overrides)[0]
            what = f"llama.cpp in-process over a {outtype} GGUF"
        elif name == "torchserve":
            config, handler = bench_config("torch", name, dtype, args, work, overrides)
            weight_dtype = bench_model.served_weight_dtype(handler, checkpoint)
            engine = TorchServeModel(name, config, checkpoint, work)
            what = f"TorchServe, the torch backend, micro-batching, {dtype} arithmetic over {weight_dtype} weights"
        elif name == "torchserve-llamacpp":
            # its build converts the checkpoint to the GGUF type the in-process row and llama-server read
            config = bench_config("llamacpp", name, dtype, args, work, {**overrides, "gguf_type": outtype})[0]
            engine = TorchServeModel(name, config, checkpoint, work)
            what = f"TorchServe, the llamacpp backend, continuous batching, over a {outtype} GGUF"
        else:
            engine, handler = in_process(name, dtype, args, work, source, overrides)
            weight_dtype = bench_model.served_weight_dtype(handler, checkpoint)
            what = f"torch in-process, {dtype} arithmetic over {weight_dtype} weights"
        nbytes = bench_model.describe(checkpoint, dtype, weight_dtype)["weight_bytes_per_token"]
        loaded[name] = (engine, nbytes, what)
        print(f"{name}: {what}, {nbytes / 1e9:.2f} GB of weights a token (load {engine.load_s:.1f} s)", flush=True)
    return loaded


def bench_config(backend: str, name: str, dtype: str, args, work: Path, overrides: dict):
    """``backend``'s bench config as system ``name`` runs it (``work/NAME.yaml``), and its handler config."""
    from llama_engine import load_model_config_file
    from scripts.bench.plan import derived_config

    config = derived_config(ROOT / BACKEND_CONFIGS[backend], work / f"{name}.yaml", dtype, args.threads, overrides)
    return config, load_model_config_file(str(config)).handler


def in_process(name: str, dtype: str, args, work: Path, source: Path, overrides: dict):
    """The engine on backend ``name``'s bench config in this process, and its handler config."""
    from scripts.bench.inprocess import InProcessEngine

    handler = bench_config(name, name, dtype, args, work, overrides)[1]
    return InProcessEngine(handler, source, max(args.streams), args.threads), handler


def bandwidth(args) -> float:
    from scripts.bench.membw import read_bandwidth

    return read_bandwidth(args.membw_gb, threads=(args.threads,), repeats=3)[str(args.threads)]["gb_per_s"]


def measure(args, loaded: dict, prompts) -> dict:
    """Alternated rounds at each stream count: every system's wave between two bandwidth samples;
    ``{(name, streams): [round, ...]}``."""
    from scripts.bench.stats import summarize

    rounds = {(name, n): [] for name in loaded for n in args.streams}
    for index in range(args.rounds):
        names = list(loaded) if index % 2 == 0 else list(loaded)[::-1]
        for n in args.streams:
            wave = [prompts.make(args.prompt) for _ in range(n)]
            for name in names:
                engine, nbytes, _ = loaded[name]
                before = bandwidth(args)
                records = engine.run_wave(wave, args.tokens)
                after = bandwidth(args)
                rates = [record.decode_tokens_per_s() for record in records]
                failed = [record.error or "no decode tokens" for record, rate in zip(records, rates)
                          if record.error or rate is None]
                if failed:
                    raise RuntimeError(f"{name}: the wave of {n} failed: {failed[0]}")
                rate = sum(rates)
                got = {"decode_tokens_per_s": round(rate, 3), "bandwidth_gb_per_s": [before, after],
                       "output_tokens_per_s": summarize(records)["output_tokens_per_s"],
                       "efficiency": round(rate / n * nbytes / ((before + after) / 2 * 1e9), 4)}
                rounds[name, n].append(got)
                print(f"round {index + 1}, {name}, {n} stream(s): {rate:.2f} decode tok/s ({1e3 * n / rate:.1f} ms a "
                      f"step), {got['output_tokens_per_s']:.2f} output tok/s with the prefill, bandwidth {before:.1f} / "
                      f"{after:.1f} GB/s, efficiency {got['efficiency']:.3f}", flush=True)
    return rounds


def summary(loaded: dict, rounds: dict, streams: list) -> dict:
    """Each system's medians at each stream count; efficiency = decode steps/s x weight bytes a token /
    bandwidth (at one stream, tokens/s; at N, a step of N rows reads the weights once)."""
    out = {}
    for name, (engine, nbytes, what) in loaded.items():
        out[name] = {"runs": what, "weight_bytes_per_token": nbytes, "streams": {}}
        if getattr(engine, "choices", None) is not None:  # a TorchServe worker's
            out[name]["load_choices"] = engine.choices
        for n in streams:
            got = rounds[name, n]
            best = max(bw for r in got for bw in r["bandwidth_gb_per_s"])
            rate = statistics.median(r["decode_tokens_per_s"] for r in got)
            out[name]["streams"][str(n)] = {
                "decode_tokens_per_s_median": rate,
                "output_tokens_per_s_median": statistics.median(r["output_tokens_per_s"] for r in got),
                "efficiency_median": statistics.median(r["efficiency"] for r in got),
                "efficiency_vs_best_bandwidth": round(rate / n * nbytes / (best * 1e9), 4), "rounds": got}
    return out


def report(results: dict, rounds: int) -> None:
    """One line a system and stream count; then each backend's speed over llama-server's, where it ran."""
    for name, got in results.items():
        for n, figures in got["streams"].items():
            print(f"{name} ({got['runs']}), {n} stream(s): decode {figures['decode_tokens_per_s_median']:.2f} tok/s, "
                  f"{figures['output_tokens_per_s_median']:.2f} output tok/s with the prefill; efficiency "
                  f"{figures['efficiency_median']:.3f} of the bandwidth bracketing each wave (median of {rounds}), "
                  f"{figures['efficiency_vs_best_bandwidth']:.3f} of the best sample", flush=True)
    peer = results.get("llama-server")
    for name in [n for n in results if peer and n != "llama-server"]:
        for n, figures in results[name]["streams"].items():
            theirs = peer["streams"][n]
            print(f"{name} / llama-server, {n} stream(s): decode "
                  f"{figures['decode_tokens_per_s_median'] / theirs['decode_tokens_per_s_median']:.2f}x, output "
                  f"{figures['output_tokens_per_s_median'] / theirs['output_tokens_per_s_median']:.2f}x", flush=True)


def figures_name(host: dict) -> str:
    """The CPU class in the default figures file's name; an emulated class names the CPU under it, so
    a run as an AVX2 CPU does not overwrite (or pass for) a real AVX2 CPU's figures."""
    emulated_on = host.get("emulated_on")
    return f"{host['cpu_class']}-on-{emulated_on}" if emulated_on else host["cpu_class"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Figures only: nothing here asserts a speed.")
    parser.add_argument("--times", type=float, default=4.0,
                        help="bf16 weights at least this many times the last-level cache (default 4)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: from --times and the cache's size)")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help=f"hidden size (default {HIDDEN})")
    parser.add_argument("--intermediate", type=int, default=INTERMEDIATE, help=f"MLP size (default {INTERMEDIATE})")
    parser.add_argument("--heads", type=int, default=HEADS, help=f"attention heads, as many KV heads (default {HEADS})")
    parser.add_argument("--backends", default=",".join(BACKENDS), type=lambda s: [b for b in s.split(",") if b],
                        help=f"comma list of {', '.join(BACKENDS)} (default all; each where installed)")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--tokens", type=int, default=48, help="generated tokens a wave (default 48)")
    parser.add_argument("--streams", default="1,8", type=lambda s: [int(n) for n in s.split(",") if n],
                        help="comma list of concurrent streams a wave (default 1,8)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    parser.add_argument("--threads", type=int, default=2, help="model threads (default 2)")
    parser.add_argument("--membw-gb", type=float, default=2.0, help="GB read by each bandwidth sample (default 2)")
    parser.add_argument("--cpu-class", help="compute as a CPU of this class would (llama_engine.cpu.CLASSES)")
    parser.add_argument("--tokenizer", type=Path, default=ROOT / "build" / "tiny-llama",
                        help="checkpoint whose tokenizer the model gets (default build/tiny-llama, as the bench model's)")
    parser.add_argument("--root", type=Path, default=ROOT / "build" / "beyond-cache", help="where the model is built")
    parser.add_argument("--out", type=Path, help="JSON of the figures (default ROOT/build/bench/beyond-cache-CLASS.json)")
    args = parser.parse_args(argv)
    unknown = set(args.backends) - set(BACKENDS)
    if unknown:
        parser.error(f"--backends: unknown {', '.join(sorted(unknown))} ({', '.join(BACKENDS)})")
    if args.prompt + args.tokens >= MAX_LENGTH:
        parser.error(f"--prompt + --tokens must stay under the configs' max_length ({MAX_LENGTH})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from scripts.bench import machine

    machine.openmp_as_served()  # before torch loads, which emulate() does
    if args.cpu_class:
        machine.emulate(args.cpu_class)
    import torch
    from transformers import AutoTokenizer

    from scripts.bench.model import ensure_bench_models
    from scripts.bench.prompts import PromptFactory
    from scripts.bench.report import cpu_label

    torch.set_num_threads(args.threads)
    host = machine.machine_info()
    cache = host["last_level_cache_bytes"]
    spec = model_spec(args, cache or UNKNOWN_CACHE_BYTES)
    args.root = args.root.resolve()
    checkpoint = ensure_bench_models(("bfloat16",), tokenizer_src=args.tokenizer.resolve(), root=args.root,
                                     spec=spec, log=lambda m: print(m, flush=True))["bfloat16"]
    weights = spec.num_hidden_layers * layer_bytes(spec.hidden_size, spec.intermediate_size)
    where = f"{cache / 2**20:.0f} MiB" if cache else f"not reported (taken as {UNKNOWN_CACHE_BYTES >> 20} MiB)"
    print(f"model: {spec.num_hidden_layers} layers of hidden {spec.hidden_size}, {weights / 1e9:.2f} GB of bf16 "
          f"linear weights; last-level cache {where}; CPU class {cpu_label(host)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="beyond-cache-") as work:
        loaded = {}
        try:
            loaded = load_backends(args, checkpoint, Path(work), loaded)
            if not loaded:
                raise SystemExit("no backend to measure")
            prompts = PromptFactory(AutoTokenizer.from_pretrained(checkpoint), 0)
            results = summary(loaded, measure(args, loaded, prompts), args.streams)
        finally:
            for engine, _, _ in loaded.values():
                engine.close()
    report(results, args.rounds)
    out = args.out or ROOT / "build" / "bench" / f"beyond-cache-{figures_name(host)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"spec": dataclasses.asdict(spec), "last_level_cache_bytes": cache, "machine": host,
                               "cpu_class": host["cpu_class"], "threads": args.threads, "prompt": args.prompt,
                               "tokens": args.tokens, "streams": args.streams, "backends": results,
                               "when": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())}, indent=1))
    print(f"wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
