"""Two served variants, waves alternated A/B, B/A, ...: which serves a stream faster here.

    python -m scripts.bench.ab_served model-config/bench-llama-llamacpp.yaml my-variant.yaml
    python -m scripts.bench.ab_served llama-server llama-server:t1 --streams 1
    python -m scripts.bench.ab_served llama-server:bf16 llama-server:f16 --checkpoint bfloat16
    python -m scripts.bench.ab_served model-config/bench-llama-continuous.yaml@HEAD model-config/bench-llama-continuous.yaml
    python -m scripts.bench.ab_served model-config/bench-llama.yaml llama-server --dtype float32 --checkpoint bfloat16

A variant is a model-config (built from the bench model into its own TorchServe, as the bench
serves it), the same at a git revision (``CONFIG@REV``: the archive is built by that revision's
own code, exported with ``git archive``, so a code change is compared served), or
``llama-server`` (``llama-server:tN``: N threads for a batch of one token, ``-t``; ``:fa-off``, ``:fa-on``:
its ``-fa``, whose default is ``auto``; ``:bf16``, ``:f16``, ``:fp32``, ``:q8_0``: that GGUF of the bench model
instead of the one the bench gives the checkpoint; as in ``llama-server:t1:fa-off:f16``).
``--a-property`` / ``--b-property KEY=VALUE`` (repeatable) set a TorchServe property of that
variant's server over config.properties', as in ``--b-property number_of_netty_threads=1`` (a
``vmargs`` given whole: its ``-Dlog4j.configurationFile`` stays relative to the repository).
Both stay up; each round sends the same wave of ``--streams`` requests to one, then the other,
in alternating order, so the machine's drift between minutes falls on both alike. Prints each
one's output tokens/s per round and the median.

It does all that twice: A's server started first, then B's first. On the AMX Xeon (2026-11-30) two
servers of the same config read B/A 1.05 at 1 stream and 1.07 at 8, and the one started second ran
its forward passes ~8% faster whichever it was (not the idle one's CPU: under 1%). The ratio over
both orders (the geometric mean) cancels that; ``--one-order`` keeps the bias, in half the time.
Needs ``make bench-models`` (and ``make bench-peers`` for llama-server). The bench's own paired
rounds (``python -m scripts.bench``) compare fixed pairs; this compares any two.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "handlers") not in sys.path:
    sys.path.insert(0, str(ROOT / "handlers"))


def make_system(variant: str, index: int, work: Path, dtype: str, threads: int, checkpoint: str,
                properties: Optional[Dict[str, str]] = None):
    """``checkpoint``: the dtype of the bench checkpoint the variants serve (and of llama-server's GGUF);
    ``properties``: TorchServe properties of this variant's server."""
    import yaml

    from llama_engine.cpu import CLASS_ENV
    from scripts.bench.model import model_dir
    from scripts.bench.plan import derived_config
    from scripts.bench.systems import LlamaCppSystem, TorchServeSystem

    if variant.startswith("llama-server"):
        if properties:
            raise SystemExit(f"{variant}: TorchServe properties ({', '.join(properties)}) are for a model-config variant")
        decode, flash_attn, gguf = llama_server_options(variant)
        # under an emulated CPU class (llama_engine.cpu.emulation_env), the llama-server built for it
        system = LlamaCppSystem(work / f"peer{index}", checkpoint, threads, parallel=8, max_length=1024,
                                gguf=gguf, decode_threads=decode, cpu_class=os.environ.get(CLASS_ENV) or None,
                                flash_attn=flash_attn)
        ok, detail = system.detect()
        if not ok:
            raise SystemExit(f"llama-server: {detail}")
        return system
    variant, _, revision = variant.partition("@")
    # a llamacpp config's GGUF as a user's build makes it (its own gguf_type: auto, the checkpoint's bf16, say, or
    # q8_0), not the arithmetic's type that the bench's derived configs set for the torch variants
    handler = yaml.safe_load(Path(variant).read_text())["handler"]
    own_gguf = {"gguf_type": handler.get("gguf_type", "auto")} if handler.get("backend") == "llamacpp" else {}
    config = derived_config(Path(variant).resolve(), work / f"variant{index}.yaml", dtype, threads, own_gguf)
    system = TorchServeSystem(work / f"variant{index}", config, model_dir(checkpoint), model_name=f"variant{index}")
    system.extra_properties = dict(properties or {})
    if revision:
        build_at_revision(system, revision, work / f"tree{index}")
    else:
        system.build()
    return system


#: ``llama-server:TYPE``: the bench model's GGUF of that type (``make bench-peers`` converts them all).
GGUF_OPTIONS = ("bf16", "f16", "fp32", "q8_0")


def llama_server_options(variant: str):
    """``llama-server[:tN][:fa-SETTING][:TYPE]`` as (``-t``, or None for the bench's threads; ``-fa``;
    the GGUF of :data:`GGUF_OPTIONS`'s TYPE, or None for the one the bench gives the checkpoint)."""
    from scripts.bench.systems import PEERS

    decode, flash_attn, gguf = None, "auto", None
    for option in variant.split(":")[1:]:
        if option[:1] == "t" and option[1:].isdigit():
            decode = int(option[1:])
        elif option in ("fa-auto", "fa-on", "fa-off"):
            flash_attn = option[3:]
        elif option in GGUF_OPTIONS:
            gguf = PEERS / f"bench-model-{option}.gguf"
        else:
            raise SystemExit(f"{variant}: unknown llama-server option {option!r} "
                             f"(tN, fa-auto, fa-on, fa-off or a GGUF type: {', '.join(GGUF_OPTIONS)})")
    return decode, flash_attn, gguf


def property_setting(text: str) -> Tuple[str, str]:
    """``KEY=VALUE`` of ``--a-property`` / ``--b-property``."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: want KEY=VALUE, a TorchServe property (number_of_netty_threads=1)")
    return key.strip(), value.strip()


def build_at_revision(system, revision: str, tree: Path) -> None:
    """Build ``system``'s archive with the project's code at ``revision`` (its handler, engine and
    build script), exported into ``tree``."""
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", revision], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    # the export has no build/: a llamacpp config's GGUF converter comes from this checkout's llama.cpp
    env = {"LLAMA_CPP_TREE": str(ROOT / "build" / "peers" / "llama.cpp"), **os.environ,
           "PYTHONPATH": f"{tree / 'handlers'}{os.pathsep}{tree}"}
    subprocess.run([sys.executable, str(tree / "scripts" / "build_model.py"), "--config", str(system.config),
                    "--checkpoint", str(system.checkpoint), "--name", system.model_name,
                    "--build-dir", str(system.work / "models" / system.model_name),
                    "--export-path", str(system.store)], cwd=tree, env=env, check=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="a model-config path (CONFIG@REV: built by a git revision's code), or "
                        "llama-server[:tN][:fa-on|fa-off]")
    parser.add_argument("b", help="the other variant, the same way")
    parser.add_argument("--streams", default="1,8", help="comma list of concurrent streams per wave (default 1,8)")
    parser.add_argument("--rounds", type=int, default=4, help="alternated rounds per stream count (default 4)")
    parser.add_argument("--input", type=int, default=256, help="prompt tokens per request (default 256)")
    parser.add_argument("--output", type=int, default=128, help="generated tokens per request (default 128)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                        help="the bench model's dtype (default: what handler.dtype auto picks here)")
    parser.add_argument("--checkpoint", choices=("bfloat16", "float32"),
                        help="serve the bench checkpoint stored in this dtype (and llama-server its GGUF) whatever "
                             "--dtype computes in; e.g. --dtype float32 --checkpoint bfloat16: a bf16 checkpoint on a "
                             "CPU without native bf16 (default: the --dtype one)")
    parser.add_argument("--threads", type=int, default=2, help="model threads of every variant (default 2)")
    for side in ("a", "b"):
        parser.add_argument(f"--{side}-property", action="append", default=[], type=property_setting,
                            metavar="KEY=VALUE", help=f"a TorchServe property of {side.upper()}'s server (repeatable)")
    parser.add_argument("--one-order", action="store_true",
                        help="start A then B only (half the time), not also B then A: the start order's bias stays in")
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from llama_engine.cpu import auto_dtype
    from scripts.bench.model import model_dir
    from scripts.bench.prompts import PromptFactory

    dtype = auto_dtype("cpu") if args.dtype == "auto" else args.dtype
    checkpoint = args.checkpoint or dtype
    prompts = PromptFactory(AutoTokenizer.from_pretrained(model_dir(checkpoint)))
    work = Path(tempfile.mkdtemp(prefix="ab-served-"))
    settings = [dict(args.a_property), dict(args.b_property)]
    names = [f"{side} {variant}" + "".join(f" {k}={v}" for k, v in props.items())
             for side, variant, props in zip("AB", (args.a, args.b), settings)]
    systems = [make_system(v, i, work, dtype, args.threads, checkpoint, settings[i] or None)
               for i, v in enumerate((args.a, args.b))]
    streams = [int(s) for s in args.streams.split(",")]
    orders = [(0, 1)] if args.one_order else [(0, 1), (1, 0)]
    ratios = {n: [] for n in streams}
    for order in orders:
        print(f"== servers started {' then '.join(names[i][0] for i in order)}", flush=True)
        rates = run_rounds(systems, order, streams, args, prompts, names)
        for n in streams:
            for name, rate in zip(names, rates[n]):
                print(f"{n} stream(s), {name}: median {statistics.median(rate):.1f} output tok/s, "
                      f"rounds {[round(r, 1) for r in rate]}", flush=True)
            ratios[n].append(statistics.median(b / a for a, b in zip(*rates[n])))
            print(f"{n} stream(s): B/A median of the rounds' ratios {ratios[n][-1]:.3f}", flush=True)
    if len(orders) == 2:
        for n in streams:
            (first, second) = ratios[n]
            print(f"{n} stream(s): B/A over both start orders {(first * second) ** 0.5:.3f} (the server started "
                  f"second ran {(first / second) ** 0.5:.3f}x as fast as the first)", flush=True)
    return 0


def run_rounds(systems, order, streams, args, prompts, names) -> dict:
    """Start ``systems`` in ``order``, warm them up alike, run the alternated rounds at each stream count and stop
    them, printing what each TorchServe worker chose; returns each count's ``[A's rates, B's rates]``."""
    from scripts.bench.stats import summarize
    from scripts.streaming_client import run_wave

    adapters = [None, None]
    try:
        for i in order:
            adapters[i] = systems[i].start(600)
        for i in order:
            run_wave(adapters[i], [prompts.make(args.input) for _ in range(8)], 32, 600)
        rates = {}
        for n in streams:
            rates[n] = [[], []]
            for round_ in range(args.rounds):
                wave = [prompts.make(args.input) for _ in range(n)]
                for i in (0, 1) if round_ % 2 == 0 else (1, 0):
                    rates[n][i].append(summarize(run_wave(adapters[i], wave, args.output, 600))["output_tokens_per_s"])
        return rates
    finally:
        for name, system in zip(names, systems):
            print_choices(name, system)
            system.stop()


def print_choices(name: str, system) -> None:
    """What a served variant's worker chose at load and while serving (a llama-server variant has no such log)."""
    from scripts.bench.choices import choices_in_log

    server = getattr(system, "server", None)
    if server is None:
        return
    log = server.model_log()
    for when, serving in (("at load", False), ("while serving", True)):
        for line in choices_in_log(log, serving=serving):
            print(f"{name} chose {when}: {line}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
