#!/usr/bin/env python3
"""Serve an uploaded artifact the way SageMaker's PyTorch container does, on this machine.

    python scripts/sagemaker_local.py s3://bucket/prefix/ [--endpoint-url URL] [--check]

SageMaker copies the S3 prefix's contents into a read-only ``/opt/ml/model`` and its
inference toolkit starts ``torchserve --models model=/opt/ml/model`` with the toolkit's
``default-ts.properties`` (``decode_input_request=false``: bodies arrive as raw bytes;
``disable_token_authorization=true``: SageMaker's ``/ping`` and ``/invocations`` carry no
TorchServe token, the endpoint is protected by IAM instead). Then it calls ``/ping`` and
``/invocations``. Reproducing that here catches layout mistakes (the nesting of the model
directory, writes into it, a missing per-model requirement) before a 30-minute endpoint
creation does.

Differences from the container, on purpose: addresses are 127.0.0.1, not 0.0.0.0, and the
model-registration API stays off. ``--check`` streams one prompt through ``/invocations``
and stops; otherwise the server runs until Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import stat
import sys
import time
from pathlib import Path

from scripts.tsctl import TorchServe, free_ports

ROOT = Path(__file__).resolve().parent.parent

MODEL_NAME = "model"  # the toolkit registers the artifact under this name
# sagemaker-pytorch-inference-toolkit: etc/default-ts.properties plus the properties it generates.
CONTAINER_PROPERTIES = {
    "enable_envvars_config": "true",
    "decode_input_request": "false",
    "enable_model_api": "false",
    "default_workers_per_model": "1",
    "default_response_timeout": "600",
}


def make_read_only(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            os.chmod(path, os.stat(path).st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


def container_server(model_dir: Path, workdir: Path, env=None) -> TorchServe:
    """A TorchServe configured as the SageMaker container starts it, on free loopback ports.

    Its environment is the one ``make deploy`` gives the endpoint (``sagemaker_deploy.DEFAULT_ENV``),
    which is what turns token authorization off: the properties alone leave it on, so a deploy
    that forgot the variable would fail here as SageMaker's /ping would.
    """
    from scripts.sagemaker_deploy import DEFAULT_ENV

    props = {**CONTAINER_PROPERTIES, "load_models": f"{MODEL_NAME}={model_dir}"}
    store = workdir / ".sagemaker" / "ts" / "models"
    store.mkdir(parents=True, exist_ok=True)
    return TorchServe(workdir, store, ports=free_ports(), base_config=None, extra=props, env={**DEFAULT_ENV, **(env or {})})


def main(argv=None) -> int:
    import boto3
    import requests

    from scripts import s3_upload
    from scripts.streaming_client import iter_messages

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("s3_uri", help="s3://bucket/prefix/ holding the uploaded model directory")
    parser.add_argument("--endpoint-url", help="an S3-compatible endpoint instead of AWS S3")
    parser.add_argument("--region", help="AWS region (default: boto3's configuration)")
    parser.add_argument("--workdir", type=Path, default=ROOT / "build" / "sagemaker-local",
                        help="the model download (opt/ml/model) and the server's files (default build/sagemaker-local)")
    parser.add_argument("--check", action="store_true", help="stream one prompt via /invocations, then stop")
    args = parser.parse_args(argv)

    model_dir = args.workdir / "opt" / "ml" / "model"
    if model_dir.exists():
        for path in [model_dir, *model_dir.rglob("*")]:
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
    s3 = boto3.client("s3", endpoint_url=args.endpoint_url, region_name=args.region)
    s3_upload.download(args.s3_uri, model_dir, s3)
    make_read_only(model_dir)
    server = container_server(model_dir.resolve(), args.workdir / "container")
    try:
        print(f"ready in {server.start_ready(timeout=900):.1f} s; POST {server.url()}/invocations", flush=True)
        if args.check:
            with requests.post(f"{server.url()}/invocations", json={"inputs": "The function returns"},
                               stream=True, timeout=300) as r:
                r.raise_for_status()
                for message in iter_messages(r.iter_content(chunk_size=None)):
                    print(message.get("token", {}).get("text", ""), end="", flush=True)
            print()
            return 0
        while server.process.poll() is None:
            time.sleep(1)
        return server.process.returncode or 0
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
