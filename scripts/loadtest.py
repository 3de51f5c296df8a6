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
import threading
import time
from pathlib import Path

import requests

from scripts.tsctl import ROOT, read_key

PROMPTS = ["The function returns", "If the object is", "A list of", "The default value is",
           "When the file", "This module provides", "Return the number of", "The following"]


def one_stream(url, headers, prompt, max_new_tokens, out):
    started = time.perf_counter()
    first = None
    tokens = 0
    with requests.post(url, json={"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}},
                       headers=headers, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines(chunk_size=None):
            if not line:
                continue
            message = json.loads(line)
            if "token" in message:
                tokens += 1
                if first is None:
                    first = time.perf_counter() - started
    out.append({"ttft": first, "tokens": tokens, "total": time.perf_counter() - started})


def run_round(url, headers, concurrency, max_new_tokens):
    out = []
    threads = [threading.Thread(target=one_stream,
                                args=(url, headers, PROMPTS[i % len(PROMPTS)], max_new_tokens, out))
               for i in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    tokens = sum(o["tokens"] for o in out)
    return {
        "concurrency": concurrency,
        "ttft_ms_p50": 1000 * statistics.median(o["ttft"] for o in out),
        "ttft_ms_max": 1000 * max(o["ttft"] for o in out),
        "tokens": tokens,
        "wall_s": wall,
        "aggregate_tokens_per_s": tokens / wall,
        "per_stream_tokens_per_s": statistics.median(o["tokens"] / o["total"] for o in out),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "serve")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    url = f"{args.url}/predictions/{args.model}"
    headers = {"Authorization": f"Bearer {read_key(args.workdir)}"}
    run_round(url, headers, 1, 4)  # warm the connection path
    for concurrency in args.concurrency:
        rounds = [run_round(url, headers, concurrency, args.max_new_tokens) for _ in range(args.rounds)]
        best = max(rounds, key=lambda r: r["aggregate_tokens_per_s"])
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in best.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
