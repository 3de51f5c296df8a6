"""The SageMaker path on loopback: upload the built artifact to a real S3-compatible server
(moto in server mode), download the prefix the way SageMaker fills /opt/ml/model, make it
read-only, start TorchServe the way the PyTorch container does, and stream through both
/invocations and /predictions/model."""
from __future__ import annotations

import json

import boto3
import pytest
import requests

from scripts import s3_upload, sagemaker_local
from scripts.streaming_client import iter_messages

from readonly import guarded_read_only_view
from s3_server import fake_aws_credentials, moto_s3_server, new_bucket


@pytest.fixture(scope="module")
def container(model_store, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    work = tmp_path_factory.mktemp("sagemaker")
    fake_aws_credentials(mp, work)
    try:
        with moto_s3_server() as endpoint:
            s3 = boto3.client("s3", endpoint_url=endpoint)
            uri = f"s3://{new_bucket(s3)}/models/tiny-llama/"
            report = s3_upload.sync(model_store / "tiny-llama", uri, s3, progress=False)
            assert not s3_upload.verify(model_store / "tiny-llama", *s3_upload.parse_s3_uri(uri), s3)
            downloaded = work / "download" / "opt" / "ml" / "model"
            s3_upload.download(uri, downloaded, s3)
        with guarded_read_only_view(downloaded, work / "ro" / "model", what="the container") as (model_dir, _):
            server = sagemaker_local.container_server(model_dir, work / "container")
            try:
                server.start_ready(timeout=300)
                server.upload_report = report
                yield server
            finally:
                server.stop()
    finally:
        mp.undo()


def test_layout_is_what_torchserve_loads(container):
    assert container.upload_report is not None
    assert requests.get(f"{container.url()}/ping", timeout=10).json()["status"] == "Healthy"


@pytest.mark.parametrize("path", ["/invocations", "/predictions/model"])
def test_streams_without_a_token_like_sagemaker(container, path):
    with requests.post(container.url() + path, data=json.dumps({"inputs": "The function returns",
                                                                "parameters": {"max_new_tokens": 6}}),
                       headers={"Content-Type": "application/json"}, stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["transfer-encoding"] == "chunked"
        messages = list(iter_messages(r.iter_content(chunk_size=None)))
    assert len(messages) == 6 and messages[-1]["details"]["generated_tokens"] == 6


def test_plain_prompt_sent_as_json_content_type_like_the_article(container, tokenizer):
    # decode_input_request=false in the container: the body reaches the handler as raw bytes.
    with requests.post(container.url() + "/invocations", data=b"Today the weather is",
                       headers={"Content-Type": "application/json"}, stream=True, timeout=120) as r:
        assert r.status_code == 200
        messages = list(iter_messages(r.iter_content(chunk_size=None)))
    assert messages[-1]["details"]["input_length"] == len(tokenizer("Today the weather is")["input_ids"])


def test_bad_request_is_a_400_through_invocations(container):
    r = requests.post(container.url() + "/invocations", json={"inputs": "x", "parameters": {"top_p": 7}}, timeout=60)
    assert r.status_code == 400 and r.json()["parameter"] == "top_p"


def test_the_deploy_environment_is_what_lets_sagemakers_ping_through(container):
    assert "disable_token_authorization" not in sagemaker_local.CONTAINER_PROPERTIES
    assert container.extra_env["TS_DISABLE_TOKEN_AUTHORIZATION"] == "true"
    assert container.auth_headers() == {}
    assert not (container.workdir / "key_file.json").exists()
