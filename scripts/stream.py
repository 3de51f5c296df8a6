#!/usr/bin/env python3
"""Stream one prompt from the local TorchServe and print tokens as they arrive.

    python scripts/stream.py "Today the weather is" --max-new-tokens 40 --details

The inference key is read from the key_file.json that TorchServe wrote into its start
directory (``build/serve`` for ``make serve``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tsctl import ROOT, read_key  # noqa: E402


def iter_ndjson(response):
    """Yield one parsed object per line, however the HTTP chunks fall."""
    for line in response.iter_lines(chunk_size=None, decode_unicode=False):
        if line:
            yield json.loads(line)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "serve",
                        help="where torchserve was started (holds key_file.json)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--details", action="store_true", help="print finish reason, TTFT and tokens/s")
    args = parser.parse_args(argv)

    params = {}
    if args.max_new_tokens is not None:
        params["max_new_tokens"] = args.max_new_tokens
    if args.temperature is not None:
        params.update(do_sample=True, temperature=args.temperature)
    headers = {"Authorization": f"Bearer {read_key(args.workdir)}", "Content-Type": "application/json"}
    started = time.perf_counter()
    first = None
    final = {}
    with requests.post(f"{args.url}/predictions/{args.model}", json={"inputs": args.prompt, "parameters": params},
                       headers=headers, stream=True, timeout=600) as response:
        if response.status_code != 200:
            print(f"HTTP {response.status_code}: {response.text}", file=sys.stderr)
            return 1
        for message in iter_ndjson(response):
            if "error" in message:
                print(f"\nerror: {message['error']}", file=sys.stderr)
                return 1
            if first is None:
                first = time.perf_counter() - started
            print(message.get("token", {}).get("text", ""), end="", flush=True)
            if "details" in message:
                final = message
    total = time.perf_counter() - started
    print()
    if args.details and final:
        d = final["details"]
        rate = d["generated_tokens"] / total if total else 0.0
        print(f"[finish_reason={d['finish_reason']} input_length={d['input_length']} "
              f"generated_tokens={d['generated_tokens']} ttft={first * 1000:.0f} ms "
              f"total={total:.2f} s tokens/s={rate:.1f}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
