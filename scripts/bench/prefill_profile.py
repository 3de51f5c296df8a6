"""Prompt (prefill) times of the torch slot backend on a model, A/B against a git revision.

A script, not a test: it prints figures and asserts nothing about speed.

    .venv/bin/python -m scripts.bench.prefill_profile                                  # bench model, HEAD's tree vs HEAD
    .venv/bin/python -m scripts.bench.prefill_profile --model build/llama-7b-shape --baseline 9fed77c

A large model cannot be loaded twice in one process's memory, so, unlike ``decode_profile``, each side
loads it in processes of its own: ``--processes`` of each, alternated (new, base, base, new, ...), so
that the drift of a shared machine falls on both alike. Each process prefills one slot ``--prefills``
times per length with seeded random token ids (the same in every process), leaves the first of them out
as a warm-up, and reports the median. The baseline's backend modules (and its native kernels' source) come
from ``git show`` (:func:`scripts.bench.decode_profile.load_baseline`). The table gives each side's
per-process medians, the ratio of their medians, and TTFT(longest) / TTFT(shortest), the bench's
TTFT growth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = ROOT / "build" / "bench-model-bf16"
#: The worker's line of results starts with this.
RESULT = "prefill-ms "


def positive_ints(text: str) -> List[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers, got {text!r}")
    return values


def prefill_times(module, model: str, lengths: Sequence[int], prefills: int, dtype: str = "auto") -> Dict[int, list]:
    """Milliseconds of each of ``prefills`` prefills of one slot, per prompt length, through ``module``'s
    ``TorchSlotBackend`` (the current ``torch_backend`` or a baseline revision's)."""
    import torch

    backend = module.TorchSlotBackend.from_pretrained(model, 1, max(lengths), dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    times = {}
    for length in lengths:
        ids = torch.randint(3, 2000, (length,), generator=gen).clamp(max=backend.model.config.vocab_size - 1).tolist()
        times[length] = []
        for _ in range(prefills):
            backend.free_slot(0)
            started = time.perf_counter()
            backend.prefill_slot(0, ids)
            times[length].append(round((time.perf_counter() - started) * 1e3, 2))
    return times


def worker(revision: str, model: str, lengths: Sequence[int], prefills: int, threads: int, dtype: str) -> dict:
    """One side in this process: the working tree's backend (``revision`` empty) or ``revision``'s. The medians
    per length, the warm-up left out."""
    import torch

    torch.set_num_threads(threads)
    if revision:
        from scripts.bench.decode_profile import load_baseline

        module = load_baseline(revision)
    else:
        from llama_engine.backends import torch_backend as module
    times = prefill_times(module, model, lengths, prefills, dtype)
    return {length: statistics.median(ms[1:] or ms) for length, ms in times.items()}


def run_side(revision: str, args) -> dict:
    """A worker process for one side; its medians by length."""
    command = [sys.executable, "-m", "scripts.bench.prefill_profile", "--worker", revision or "-",
               "--model", str(args.model), "--lengths", ",".join(map(str, args.lengths)),
               "--prefills", str(args.prefills), "--threads", str(args.threads), "--dtype", args.dtype]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(RESULT)), None)
    if done.returncode != 0 or line is None:
        sys.exit(f"the {'baseline' if revision else 'current'} side failed (exit {done.returncode}):\n"
                 f"{done.stderr[-2000:]}")
    return {int(k): v for k, v in json.loads(line[len(RESULT):]).items()}


def table(lengths: Sequence[int], new: List[dict], old: List[dict]) -> List[str]:
    """The rows: each length's per-process medians of both sides and their ratio, then the TTFT growth."""
    def cell(runs, length):
        return "/".join(f"{run[length]:.1f}" for run in runs) or "-"

    def growth(runs, long, short):
        return "/".join(f"{run[long] / run[short]:.2f}" for run in runs) or "-"

    rows = [f"{'tokens':>6s} | {'base ms (each process)':>28s} | {'new ms (each process)':>28s} | speedup"]
    for length in lengths:
        ratio = (f"{statistics.median(r[length] for r in old) / statistics.median(r[length] for r in new):.2f}x"
                 if old else "-")
        rows.append(f"{length:6d} | {cell(old, length):>28s} | {cell(new, length):>28s} | {ratio}")
    if len(lengths) > 1:
        short, long = min(lengths), max(lengths)
        rows.append(f"TTFT({long}) / TTFT({short}): base {growth(old, long, short)}, new {growth(new, long, short)}")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="model directory (default: the bench model)")
    p.add_argument("--baseline", default="HEAD", help="git revision to compare with")
    p.add_argument("--no-baseline", action="store_true", help="time the current code only")
    p.add_argument("--lengths", type=positive_ints, default=[256, 768], help="comma list of prompt lengths")
    p.add_argument("--prefills", type=int, default=4, help="prefills per length in each process (the first a warm-up)")
    p.add_argument("--processes", type=int, default=2, help="processes per side, alternated")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--dtype", default="auto", help="handler.dtype (default auto)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (args.model / "config.json").exists():
        p.error(f"{args.model} has no config.json (the bench model: python -m scripts.bench --quick builds it)")

    if args.worker is not None:
        medians = worker("" if args.worker == "-" else args.worker, str(args.model), args.lengths, args.prefills,
                         args.threads, args.dtype)
        print(RESULT + json.dumps(medians), flush=True)
        return 0
    baseline = None if args.no_baseline else args.baseline
    print(f"{args.model}, {args.threads} threads, dtype {args.dtype}, {args.processes} process(es) a side, "
          f"{args.prefills} prefills a length each, baseline {baseline or '-'}", flush=True)
    new, old = [], []
    for p_index in range(args.processes):
        sides = [("", new), (baseline, old)] if p_index % 2 == 0 else [(baseline, old), ("", new)]
        for revision, sink in sides:
            if revision is not None:
                sink.append(run_side(revision, args))
    for row in table(args.lengths, new, old):
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
