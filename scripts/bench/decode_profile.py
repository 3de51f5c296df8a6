"""Decode ms/step and tok/s of the torch backends on the bench model, A/B against a git revision.

A script, not a test: it prints figures and asserts nothing about speed.

    .venv/bin/python -m scripts.bench.decode_profile                    # HEAD's working tree vs --baseline
    .venv/bin/python -m scripts.bench.decode_profile --baseline 1b9cabc --rounds 10
    .venv/bin/python -m scripts.bench.decode_profile --profile          # + torch.profiler tables (current code)

For every (backend, dtype, batch) it loads the model twice, once through the current
``torch_backend`` and once through the baseline revision's (``git show REV:...``), prefills the
same prompt into both, then alternates blocks of decode steps between them (A B A B ...,
``--rounds`` blocks of ``--block`` steps each), so that the drift of a shared, busy machine
falls on both alike. It reports the median step time of each side (tok/s = batch / median),
the fastest step (the least disturbed, a second view on a busy machine) and the ratios. Other work
on the machine still adds noise: read differences under ~15% as noise unless they repeat.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = "handlers/llama_engine/backends"
#: The modules taken from the baseline revision, in import order: a kernel change in
#: ``cpu_kernels`` (its C++ source too: the baseline builds its own library) or ``fast_linear`` is
#: compared as well as one in ``torch_backend``.
MODULES = ("cpu_kernels", "fast_linear", "torch_backend")
#: Modules a revision may predate (its other modules then do not import them).
OPTIONAL = ("cpu_kernels",)


def git_show(rev: str, path: str) -> Optional[str]:
    done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def load_baseline(rev: str):
    """The baseline revision's torch_backend module (over its own fast_linear and native kernels),
    importable next to the current one."""
    module, loaded = None, []
    tree = Path(tempfile.mkdtemp(prefix="decode-profile-"))
    for stem in MODULES:
        source = git_show(rev, f"{BACKENDS}/{stem}.py")
        if source is None:
            if stem in OPTIONAL:
                continue
            sys.exit(f"{rev}:{BACKENDS}/{stem}.py does not exist")
        for earlier in loaded:
            source = source.replace(f"from .{earlier} import", f"from ._baseline_{earlier} import")
            source = source.replace(f"from . import {earlier}", f"from . import _baseline_{earlier} as {earlier}")
        if stem == "cpu_kernels":  # the revision's C++ next to its module, built into its own library
            (tree / "cpu_kernels.cpp").write_text(git_show(rev, f"{BACKENDS}/cpu_kernels.cpp"))
        name = f"llama_engine.backends._baseline_{stem}"
        spec = importlib.util.spec_from_loader(name, loader=None)
        module = importlib.util.module_from_spec(spec)
        module.__package__ = "llama_engine.backends"
        module.__file__ = str(tree / f"{stem}.py")
        sys.modules[name] = module
        exec(compile(source, f"{rev}:{BACKENDS}/{stem}.py", "exec"), module.__dict__)
        loaded.append(stem)
    return module


class Runner:
    """One backend with a prefilled batch; ``step()`` runs one decode step."""

    def __init__(self, module, kind: str, model_path: str, dtype: str, batch: int, prompt: int, max_length: int):
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 2000, (batch, prompt), generator=gen)
        self.tokens = torch.randint(3, 2000, (batch,), generator=gen)
        if kind == "static":
            self.backend = module.TorchBackend(model_path, dtype=dtype, device="cpu", max_length=max_length)
            self.backend.prefill(ids, torch.ones_like(ids))
            self.step = lambda: self.backend.decode(self.tokens)
        else:
            self.backend = module.TorchSlotBackend.from_pretrained(model_path, batch, max_length, dtype, "cpu")
            for slot in range(batch):
                self.backend.prefill_slot(slot, ids[slot].tolist())
            slots, tokens = list(range(batch)), self.tokens.tolist()
            self.step = lambda: self.backend.decode_slots(slots, tokens)

    def timed(self, n: int):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - start)
        return times


def model_path(dtype: str) -> str:
    path = ROOT / "build" / ("bench-model-bf16" if dtype == "bfloat16" else "bench-model-fp32")
    if not (path / "model.safetensors").exists():
        sys.exit(f"{path} is missing: build it with scripts/bench/model.py (python -m scripts.bench --quick builds it)")
    return str(path)


def profile_table(runner: Runner, steps: int = 10) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.timed(steps)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default="HEAD", help="git revision of torch_backend.py to compare with")
    p.add_argument("--backends", default="static,slot", help="static (TorchBackend), slot (TorchSlotBackend)")
    p.add_argument("--dtypes", default="bfloat16,float32", help="comma list of dtypes, each its bench model")
    p.add_argument("--batches", default="1,8", help="comma list of batch sizes (rows decoding together)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per row before decoding")
    p.add_argument("--rounds", type=int, default=8, help="A/B blocks per side")
    p.add_argument("--block", type=int, default=4, help="decode steps per block")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table for the current code")
    p.add_argument("--no-baseline", action="store_true", help="time the current code only")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    from llama_engine.backends import torch_backend as current

    baseline = None if args.no_baseline else load_baseline(args.baseline)
    max_length = args.prompt + 2 * args.rounds * args.block + 16
    print(f"torch {torch.__version__}, {args.threads} threads, prompt {args.prompt}, "
          f"{args.rounds} rounds x {args.block} steps per side, baseline {args.baseline}")
    header = f"{'backend':7s} {'dtype':9s} {'B':>2s} | {'base ms':>8s} {'(min)':>6s} {'base tok/s':>10s} | " \
             f"{'new ms':>8s} {'(min)':>6s} {'new tok/s':>9s} | {'speedup':>7s} {'(min)':>6s}"
    print(header)
    print("-" * len(header))
    for kind in args.backends.split(","):
        for dtype in args.dtypes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                path = model_path(dtype)
                new = Runner(current, kind, path, dtype, batch, args.prompt, max_length)
                old = None if baseline is None else Runner(baseline, kind, path, dtype, batch, args.prompt,
                                                           max_length)
                new.timed(2)
                if old is not None:
                    old.timed(2)
                t_new, t_old = [], []
                for r in range(args.rounds):
                    order = [(new, t_new), (old, t_old)] if r % 2 == 0 else [(old, t_old), (new, t_new)]
                    for runner, sink in order:
                        if runner is not None:
                            sink.extend(runner.timed(args.block))
                ms_new, min_new = statistics.median(t_new) * 1e3, min(t_new) * 1e3
                if old is not None:
                    ms_old, min_old = statistics.median(t_old) * 1e3, min(t_old) * 1e3
                    base = f"{ms_old:8.1f} {min_old:6.1f} {batch / ms_old * 1e3:10.1f}"
                    ratio = f"{ms_old / ms_new:6.2f}x {min_old / min_new:5.2f}x"
                else:
                    base, ratio = f"{'-':>8s} {'-':>6s} {'-':>10s}", f"{'-':>7s} {'-':>6s}"
                print(f"{kind:7s} {dtype:9s} {batch:2d} | {base} | {ms_new:8.1f} {min_new:6.1f} "
                      f"{batch / ms_new * 1e3:9.1f} | {ratio}", flush=True)
                if args.profile:
                    print(profile_table(new))
                del new, old
    return 0


if __name__ == "__main__":
    sys.exit(main())
