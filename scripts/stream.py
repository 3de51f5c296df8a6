#!/usr/bin/env python3
"""Stream one prompt and print tokens as they arrive, from a local TorchServe or a SageMaker endpoint.

    python scripts/stream.py "Today the weather is" --max-new-tokens 40 --details
    python scripts/stream.py "Today the weather is" --sagemaker-endpoint my-endpoint --region us-east-1

Locally, the inference key is read from the key_file.json that TorchServe wrote into its
start directory (``build/serve`` for ``make serve``). On SageMaker the request goes through
``invoke_endpoint_with_response_stream`` with the standard boto3 credential chain; its
``PayloadPart`` events split the NDJSON stream at arbitrary byte offsets; the shared reader
(``scripts/streaming_client.py``) reassembles whole lines (and whole UTF-8 characters) before
parsing them.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Iterator

from scripts.streaming_client import RequestRecord, StreamTimeout, iter_messages, post_chunks, read_stream

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_URL = "http://127.0.0.1:8080"


def local_url(workdir: Path) -> str:
    """The inference address of the server started from ``workdir`` (``make serve``'s), else the default."""
    from scripts.tsctl import read_properties

    config = workdir / "config.properties"
    if config.is_file():
        return read_properties(config).get("inference_address", DEFAULT_URL)
    return DEFAULT_URL


def local_chunks(args, body: dict) -> Iterator[bytes]:
    """The response body's chunks; a stream cut short (its worker died) is a StreamError that says so."""
    from scripts.tsctl import read_key

    headers = {"Authorization": f"Bearer {read_key(args.workdir)}", "Content-Type": "application/json"}
    url = f"{args.url or local_url(args.workdir)}/predictions/{args.model}"
    return post_chunks(url, body, headers, read_timeout=args.read_timeout)


def sagemaker_chunks(args, body: dict) -> Iterator[dict]:
    import boto3

    runtime = boto3.client("sagemaker-runtime", region_name=args.region)
    response = runtime.invoke_endpoint_with_response_stream(
        EndpointName=args.sagemaker_endpoint, Body=json.dumps(body).encode("utf-8"),
        ContentType="application/json")
    yield from response["Body"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="the prompt to stream an answer to")
    parser.add_argument("--url", help="TorchServe's inference address (default: the one of --workdir's "
                        f"config.properties, else {DEFAULT_URL})")
    parser.add_argument("--model", default="tiny-llama", help="the model name in /predictions/<model>")
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "serve",
                        help="where torchserve was started (holds key_file.json)")
    parser.add_argument("--sagemaker-endpoint", help="stream from this SageMaker endpoint instead")
    parser.add_argument("--region", help="AWS region of the endpoint (default: the boto3 chain's)")
    parser.add_argument("--max-new-tokens", type=int, help="tokens to generate (default: the model-config's)")
    parser.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    parser.add_argument("--read-timeout", type=float, default=300,
                        help="seconds to wait for the next chunk before giving up (default 300)")
    parser.add_argument("--details", action="store_true", help="print finish reason, TTFT and tokens/s")
    args = parser.parse_args(argv)

    params = {}
    if args.max_new_tokens is not None:
        params["max_new_tokens"] = args.max_new_tokens
    if args.temperature is not None:
        params.update(do_sample=True, temperature=args.temperature)
    body = {"inputs": args.prompt, "parameters": params}
    source = sagemaker_chunks if args.sagemaker_endpoint else local_chunks
    record = RequestRecord("torchserve", None, args.max_new_tokens)
    record.start = time.perf_counter()
    try:
        read_stream(iter_messages(source(args, body)), record, on_text=lambda text: print(text, end="", flush=True))
    except StreamTimeout as exc:
        print(f"\nerror: {exc} (--read-timeout)", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # a StreamError, or SageMaker's stream errors
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    if record.end is None and not args.sagemaker_endpoint:
        print("\nerror: the stream ended without its final message", file=sys.stderr)
        return 1
    total = time.perf_counter() - record.start
    print()
    if args.details and record.details:
        d = record.details
        first = record.ttft if record.token_times else total
        rate = d["generated_tokens"] / total if total else 0.0
        print(f"[finish_reason={d['finish_reason']} input_length={d['input_length']} "
              f"generated_tokens={d['generated_tokens']} ttft={first * 1000:.0f} ms "
              f"total={total:.2f} s tokens/s={rate:.1f}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
