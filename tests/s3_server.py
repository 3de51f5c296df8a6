"""A real S3-compatible server on loopback for tests: moto in server mode, on a free port.

    from s3_server import fake_aws_credentials, moto_s3_server

    with moto_s3_server() as endpoint_url:
        s3 = boto3.client("s3", endpoint_url=endpoint_url)

Requests go over HTTP to 127.0.0.1 through botocore's whole stack (signing, checksums,
multipart), which an in-process mock would skip. Nothing here reaches AWS.
"""
from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Iterator

FAKE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# variables that could point boto3 at real credentials or another endpoint
CLEARED_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE",
               "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL_SAGEMAKER", "AWS_REGION",
               "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI")


def fake_aws_credentials(monkeypatch, tmp_path) -> None:
    """Fake credentials and region in the environment; no shared config or metadata service."""
    for name in CLEARED_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in FAKE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@contextlib.contextmanager
def moto_s3_server() -> Iterator[str]:
    """Start moto's server on 127.0.0.1 (a free port) and yield its endpoint URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def new_bucket(s3) -> str:
    """A fresh bucket, so tests sharing one server do not see each other's objects."""
    name = f"test-{uuid.uuid4().hex[:20]}"
    s3.create_bucket(Bucket=name)
    return name
