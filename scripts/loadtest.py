#!/usr/bin/env python3
"""Measure streaming figures against a running server: TTFT and tokens/s at a concurrency.

    python scripts/loadtest.py --concurrency 1 8 --max-new-tokens 64

A stream may stop early at EOS, so tokens/s counts the tokens actually streamed.
Aggregate tokens/s = all tokens streamed in a round / the round's wall time; the best of
``--rounds`` rounds is printed, one JSON line per concurrency.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from scripts.streaming_client import StreamError, TorchServeAdapter, run_wave
from scripts.tsctl import ROOT, read_key

PROMPTS = ["The function returns", "If the object is", "A list of", "The default value is",
           "When the file", "This module provides", "Return the number of", "The following"]


def run_round(adapter: TorchServeAdapter, concurrency: int, max_new_tokens: int, timeout: float = 600) -> dict:
    """``concurrency`` streams at once (the shared client's wave); a failed stream raises StreamError."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(concurrency)]
    started = time.perf_counter()
    records = run_wave(adapter, prompts, max_new_tokens, timeout)
    wall = time.perf_counter() - started
    failed = [r.error or "no token" for r in records if not r.ok]
    if failed:
        raise StreamError(f"{len(failed)} of {concurrency} streams failed: {failed[0]}")
    tokens = sum(len(r.token_times) for r in records)
    return {
        "concurrency": concurrency,
        "ttft_ms_p50": 1000 * statistics.median(r.ttft for r in records),
        "ttft_ms_max": 1000 * max(r.ttft for r in records),
        "tokens": tokens,
        "wall_s": wall,
        "aggregate_tokens_per_s": tokens / wall,
        "per_stream_tokens_per_s": statistics.median(len(r.token_times) / r.e2e for r in records),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="TorchServe's inference address")
    parser.add_argument("--model", default="tiny-llama", help="the model name in /predictions/<model>")
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "serve",
                        help="where torchserve was started (holds key_file.json)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8],
                        help="concurrent streams, one JSON line each (default 1 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per stream (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per concurrency; the best is printed (default 3)")
    args = parser.parse_args(argv)

    adapter = TorchServeAdapter(args.url, args.model, {"Authorization": f"Bearer {read_key(args.workdir)}"})
    try:
        run_round(adapter, 1, 4)  # warm the connection path
        for concurrency in args.concurrency:
            rounds = [run_round(adapter, concurrency, args.max_new_tokens) for _ in range(args.rounds)]
            best = max(rounds, key=lambda r: r["aggregate_tokens_per_s"])
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in best.items()}))
    except StreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
