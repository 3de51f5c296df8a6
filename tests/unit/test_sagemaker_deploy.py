"""scripts/sagemaker_deploy.py: every request checked against botocore's real SageMaker model.

botocore's Stubber asserts each call's parameters exactly, and the client validates them
against the service model before the stub answers (names, types, required members, minimum
values); ``check_against_model`` adds what that validation leaves out (enums, maximum
lengths and values, patterns), so a request that passes here is one the API accepts.
"""
from __future__ import annotations

import json
import re
from datetime import datetime, timezone
from pathlib import Path

import boto3
import botocore.session
import pytest
from botocore.stub import Stubber

from llama_engine.config import load_model_config_file
from scripts import sagemaker_deploy

from s3_server import fake_aws_credentials

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "model-config").glob("*.yaml"))
TINY_NEURON = ROOT / "model-config" / "tiny-llama-neuron.yaml"
NAME = "tiny-llama-neuron-test"
ROLE = "arn:aws:iam::123456789012:role/SageMakerExecution"
IMAGE = ("763104330519.dkr.ecr.us-east-1.amazonaws.com/pytorch-inference-neuronx:"
         "2.1.2-neuronx-py310-sdk2.20.0-ubuntu20.04")
S3_URI = "s3://models-bucket/tiny-llama-neuron/"
ARN = "arn:aws:sagemaker:us-east-1:123456789012:{}/" + NAME
MODEL = botocore.session.get_session().get_service_model("sagemaker")


def check_against_model(op: str, params: dict) -> None:
    shape = MODEL.operation_model(op).input_shape
    errors = []
    _check(shape, params, op, errors)
    assert not errors, errors


def _check(shape, value, path, errors):
    meta = shape.metadata
    kind = shape.type_name
    if kind == "structure":
        if not isinstance(value, dict):
            return errors.append(f"{path}: expected a structure")
        for key in shape.required_members:
            if key not in value:
                errors.append(f"{path}.{key}: required")
        for key, item in value.items():
            if key not in shape.members:
                errors.append(f"{path}.{key}: unknown member")
            else:
                _check(shape.members[key], item, f"{path}.{key}", errors)
    elif kind == "list":
        _bounds(len(value), meta, path, errors)
        for i, item in enumerate(value):
            _check(shape.member, item, f"{path}[{i}]", errors)
    elif kind == "map":
        _bounds(len(value), meta, path, errors)
        for key, item in value.items():
            _check(shape.key, key, f"{path} key {key!r}", errors)
            _check(shape.value, item, f"{path}[{key!r}]", errors)
    elif kind == "string":
        if not isinstance(value, str):
            return errors.append(f"{path}: expected a string")
        if shape.enum and value not in shape.enum:
            errors.append(f"{path}: {value!r} not one of the API's values")
        _bounds(len(value), meta, path, errors)
        if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
            errors.append(f"{path}: {value!r} does not match {meta['pattern']}")
    elif kind in ("integer", "long"):
        if not isinstance(value, int) or isinstance(value, bool):
            return errors.append(f"{path}: expected an integer")
        _bounds(value, meta, path, errors)


def _bounds(n, meta, path, errors):
    if "min" in meta and n < meta["min"]:
        errors.append(f"{path}: {n} below the minimum {meta['min']}")
    if "max" in meta and n > meta["max"]:
        errors.append(f"{path}: {n} above the maximum {meta['max']}")


@pytest.fixture
def client(monkeypatch, tmp_path):
    fake_aws_credentials(monkeypatch, tmp_path)
    sm = boto3.client("sagemaker", region_name="us-east-1")
    with Stubber(sm) as stubber:
        sm.stubber = stubber
        yield sm
        stubber.assert_no_pending_responses()


def expected_model(env=None):
    return {
        "ModelName": NAME,
        "ExecutionRoleArn": ROLE,
        "PrimaryContainer": {
            "Image": IMAGE,
            "ModelDataSource": {"S3DataSource": {"S3Uri": S3_URI, "S3DataType": "S3Prefix", "CompressionType": "None"}},
            "Environment": {"TS_INSTALL_PY_DEP_PER_MODEL": "true", "OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000",
                            "TS_DISABLE_TOKEN_AUTHORIZATION": "true", **(env or {})},
        },
    }


def expected_endpoint_config(instance_type="ml.inf2.xlarge", volume=30):
    variant = {
        "VariantName": "AllTraffic",
        "ModelName": NAME,
        "InstanceType": instance_type,
        "InitialInstanceCount": 1,
        "ModelDataDownloadTimeoutInSeconds": 600,
        "ContainerStartupHealthCheckTimeoutInSeconds": 900,
    }
    if volume is not None:
        variant["VolumeSizeInGB"] = volume
    return {"EndpointConfigName": NAME, "ProductionVariants": [variant]}


def expected_endpoint():
    return {"EndpointName": NAME, "EndpointConfigName": NAME}


def stub_creates(sm, model=None, endpoint_config=None):
    for op, params, response in (
        ("create_model", model or expected_model(), {"ModelArn": ARN.format("model")}),
        ("create_endpoint_config", endpoint_config or expected_endpoint_config(),
         {"EndpointConfigArn": ARN.format("endpoint-config")}),
        ("create_endpoint", expected_endpoint(), {"EndpointArn": ARN.format("endpoint")}),
    ):
        check_against_model(MODEL.operation_model(op.title().replace("_", "")).name, params)
        sm.stubber.add_response(op, response, params)


def stub_status(sm, status, reason=None):
    now = datetime(2024, 1, 1, tzinfo=timezone.utc)
    response = {"EndpointName": NAME, "EndpointArn": ARN.format("endpoint"), "EndpointConfigName": NAME,
                "EndpointStatus": status, "CreationTime": now, "LastModifiedTime": now}
    if reason:
        response["FailureReason"] = reason
    sm.stubber.add_response("describe_endpoint", response, {"EndpointName": NAME})


def deploy_args(*extra, config=TINY_NEURON):
    return ["deploy", "--config", str(config), "--s3-uri", S3_URI, "--role-arn", ROLE, "--image-uri", IMAGE,
            "--name", NAME, "--poll-interval", "0", *extra]


def test_deploy_creates_three_resources_and_waits_for_in_service(client, capsys):
    stub_creates(client)
    for status in ("Creating", "Creating", "Creating", "InService"):
        stub_status(client, status)
    assert sagemaker_deploy.main(deploy_args(), client=client) == 0
    out = capsys.readouterr().out
    assert out.count("Creating") == 1 and re.search(r"\[\d+m\d\ds\] Creating\n.*\[\d+m\d\ds\] InService", out, re.S)
    assert f"created Model {NAME}" in out and f"created Endpoint {NAME}" in out
    assert f"endpoint {NAME} is InService ({ARN.format('endpoint')})" in out


def test_failed_endpoint_exits_non_zero_with_the_failure_reason(client, capsys):
    reason = ("The primary container for production variant AllTraffic did not pass the ping health check. "
              "Please check CloudWatch logs for this endpoint.")
    stub_creates(client)
    stub_status(client, "Creating")
    stub_status(client, "Failed", reason)
    assert sagemaker_deploy.main(deploy_args(), client=client) == 1
    captured = capsys.readouterr()
    assert f"endpoint {NAME} is Failed: {reason}" in captured.err
    assert f"undeploy --name {NAME}" in captured.err
    assert "Failed" in captured.out


def test_a_rejected_create_names_what_exists_and_exits_non_zero(client, capsys):
    client.stubber.add_response("create_model", {"ModelArn": ARN.format("model")}, expected_model())
    client.stubber.add_client_error("create_endpoint_config", "ResourceLimitExceeded",
                                    "account-level service limit 'ml.inf2.xlarge for endpoint usage' is 0",
                                    http_status_code=400, expected_params=expected_endpoint_config())
    assert sagemaker_deploy.main(deploy_args(), client=client) == 1
    err = capsys.readouterr().err
    assert f"CreateEndpointConfig failed; created before it: Model {NAME}" in err
    assert "ResourceLimitExceeded" in err and f"undeploy --name {NAME}" in err


def test_no_wait_returns_after_create_endpoint(client, capsys):
    stub_creates(client)
    assert sagemaker_deploy.main(deploy_args("--no-wait"), client=client) == 0
    assert "not waiting" in capsys.readouterr().out


def test_waiting_gives_up_after_the_timeout(client, capsys):
    stub_creates(client)
    stub_status(client, "Creating")
    assert sagemaker_deploy.main(deploy_args("--timeout", "0"), client=client) == 1
    assert f"endpoint {NAME} still Creating after 0m00s" in capsys.readouterr().err


def test_dry_run_prints_the_exact_requests_and_sends_nothing(client, monkeypatch, capsys):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(var)
    monkeypatch.setattr(sagemaker_deploy, "make_client", lambda *a, **k: pytest.fail("dry run made a client"))
    assert sagemaker_deploy.main(deploy_args("--dry-run", "--env", "LOG_LEVEL=debug")) == 0
    assert sagemaker_deploy.main(deploy_args("--dry-run"), client=client) == 0  # the stub has nothing queued
    out = capsys.readouterr().out.split("dry run: nothing was sent\n")[0]
    requests = re.findall(r"^(\w+)\n(\{.*?^\})", out, re.S | re.M)
    assert [(op, json.loads(body)) for op, body in requests] == [
        ("CreateModel", expected_model({"LOG_LEVEL": "debug"})),
        ("CreateEndpointConfig", expected_endpoint_config()),
        ("CreateEndpoint", expected_endpoint()),
    ]


def test_undeploy_deletes_endpoint_config_and_model_tolerating_missing_ones(client, capsys):
    client.stubber.add_response("delete_endpoint", {}, {"EndpointName": NAME})
    client.stubber.add_client_error("delete_endpoint_config", "ValidationException",
                                    f'Could not find endpoint configuration "{ARN.format("endpoint-config")}".',
                                    expected_params={"EndpointConfigName": NAME})
    client.stubber.add_response("delete_model", {}, {"ModelName": NAME})
    assert sagemaker_deploy.main(["undeploy", "--name", NAME], client=client) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [f"undeploying {NAME}:", f"  Endpoint {NAME}: deleted",
                                f"  EndpointConfig {NAME}: not found (already gone)", f"  Model {NAME}: deleted"]


def test_undeploy_of_nothing_succeeds_and_other_errors_fail(client, capsys):
    for op, what, param in (("delete_endpoint", "endpoint", "EndpointName"),
                            ("delete_endpoint_config", "endpoint configuration", "EndpointConfigName"),
                            ("delete_model", "model", "ModelName")):
        client.stubber.add_client_error(op, "ValidationException", f'Could not find {what} "{NAME}".',
                                        expected_params={param: NAME})
    assert sagemaker_deploy.main(["undeploy", "--name", NAME], client=client) == 0
    assert capsys.readouterr().out.count("not found (already gone)") == 3

    client.stubber.add_client_error("delete_endpoint", "AccessDeniedException", "not authorized",
                                    expected_params={"EndpointName": NAME})
    assert sagemaker_deploy.main(["undeploy", "--name", NAME], client=client) == 1
    assert "AccessDeniedException" in capsys.readouterr().err


def test_instance_type_override(client, capsys):
    stub_creates(client, endpoint_config=expected_endpoint_config("ml.inf2.8xlarge"))
    assert sagemaker_deploy.main(deploy_args("--instance-type", "ml.inf2.8xlarge", "--no-wait"), client=client) == 0


def test_instance_types_with_instance_storage_get_no_volume_size():
    cfg = load_model_config_file(str(ROOT / "model-config" / "tiny-llama.yaml"))
    for instance_type, volume in (("ml.g5.2xlarge", None), ("ml.p4d.24xlarge", None), ("ml.trn1.2xlarge", None),
                                  ("ml.m5.xlarge", 30), ("ml.inf2.xlarge", 30), ("ml.c7i.large", 30)):
        variant = sagemaker_deploy.production_variant(NAME, cfg.sagemaker, instance_type)
        assert variant.get("VolumeSizeInGB") == volume, instance_type


def test_neuron_configs_refuse_instances_without_enough_neuron_cores(capsys):
    big = ROOT / "model-config" / "llama-2-13b-inf2-24xlarge-b1.yaml"
    for config, instance_type, message in ((big, "ml.inf2.8xlarge", "ml.inf2.8xlarge has 2 NeuronCores"),
                                           (TINY_NEURON, "ml.m5.xlarge", "has no NeuronCores")):
        with pytest.raises(SystemExit) as info:
            sagemaker_deploy.main(deploy_args("--instance-type", instance_type, "--dry-run", config=config))
        assert info.value.code == 2
        assert message in capsys.readouterr().err


def test_llamacpp_configs_warn_that_the_image_needs_llama_cpp():
    cfg = load_model_config_file(str(ROOT / "model-config" / "tiny-llama-llamacpp.yaml"))
    warnings = sagemaker_deploy.check_hardware(cfg, "ml.m5.xlarge")
    assert any("llama-cpp-python" in w and "IMAGE_URI" in w for w in warnings)
    torch_cfg = load_model_config_file(str(ROOT / "model-config" / "tiny-llama.yaml"))
    assert not any("llama-cpp-python" in w for w in sagemaker_deploy.check_hardware(torch_cfg, "ml.m5.xlarge"))


def test_tiny_llama_neuron_is_sized_for_ml_inf2_xlarge():
    cfg = load_model_config_file(str(TINY_NEURON))
    requests = sagemaker_deploy.deploy_requests(cfg, name=NAME, s3_uri=S3_URI, role_arn=ROLE, image_uri=IMAGE)
    assert requests[1] == ("CreateEndpointConfig", expected_endpoint_config("ml.inf2.xlarge", 30))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_makes_requests_the_api_accepts(config):
    cfg = load_model_config_file(str(config))
    name = sagemaker_deploy.default_name(config)
    requests = sagemaker_deploy.deploy_requests(cfg, name=name, s3_uri="s3://b/p", role_arn=ROLE, image_uri=IMAGE)
    variant = requests[1][1]["ProductionVariants"][0]
    assert variant["InstanceType"] == cfg.sagemaker.instance_type
    assert variant["VolumeSizeInGB"] == cfg.sagemaker.volume_size_gb
    assert variant["ModelDataDownloadTimeoutInSeconds"] == cfg.sagemaker.model_data_download_timeout
    health = cfg.sagemaker.container_startup_health_check_timeout
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == health
    for op, params in requests + sagemaker_deploy.undeploy_requests(name):
        check_against_model(op, params)
    sagemaker_deploy.check_hardware(cfg, variant["InstanceType"])


def test_default_names_are_valid_sagemaker_names():
    now = datetime(2024, 5, 6, 7, 8, 9, tzinfo=timezone.utc)
    assert sagemaker_deploy.default_name("model-config/tiny-llama-neuron.yaml", now) == \
        "tiny-llama-neuron-20240506-070809"
    long = sagemaker_deploy.default_name("x/" + "very_long.name-" * 8 + ".yaml", now)
    assert len(long) <= 63 and long.endswith("-20240506-070809") and "_" not in long and "--" not in long
    assert sagemaker_deploy.default_name("__.yaml", now) == "model-20240506-070809"
    for bad in ("-lead", "trail-", "under_score", "a" * 64, ""):
        with pytest.raises(ValueError):
            sagemaker_deploy.check_name(bad)


def test_an_invalid_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        sagemaker_deploy.main(["undeploy", "--name", "bad_name", "--dry-run"])
    assert info.value.code == 2 and "invalid SageMaker name 'bad_name'" in capsys.readouterr().err
