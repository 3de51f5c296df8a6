#!/usr/bin/env python3
"""Create or delete the SageMaker model, endpoint config and endpoint of an uploaded model.

    python scripts/sagemaker_deploy.py deploy --config model-config/llama-2-13b-inf2-24xlarge-b1.yaml \\
        --s3-uri s3://my-bucket/llama-2-13b-b1/ --role-arn arn:aws:iam::123456789012:role/SageMakerExecution \\
        --image-uri 763104330519.dkr.ecr.us-east-1.amazonaws.com/pytorch-inference-neuronx:TAG
    python scripts/sagemaker_deploy.py undeploy --name llama-2-13b-inf2-24xlarge-b1-20240101-120000

``deploy`` sends CreateModel (the container with the uncompressed model under ``--s3-uri``,
as ``scripts/s3_upload.py`` uploaded it), CreateEndpointConfig (one variant, sized from the
config's ``sagemaker:`` section) and CreateEndpoint, all three under one name, then polls
DescribeEndpoint until the endpoint is InService, printing each status change with the
elapsed time. A Failed endpoint exits 1 with SageMaker's FailureReason; what was created is
left for inspection and ``undeploy`` removes it. ``--dry-run`` prints the requests (operation
and JSON parameters) and sends nothing, so it needs no credentials.

``undeploy`` deletes the endpoint, the endpoint config and the model of that name, in that
order; one that is already gone is reported and skipped.

The image (``--image-uri``, required) is the PyTorch Neuronx inference Deep Learning
Container, which runs TorchServe. Its URIs are listed in aws/deep-learning-containers'
``available_images.md`` under "Neuron Inference Containers": account 763104330519 in most
regions, repository ``pytorch-inference-neuronx``, tags of the form
``<torch>-neuronx-py310-sdk<neuron sdk>-ubuntu<version>``; ``aws ecr describe-images
--registry-id 763104330519 --repository-name pytorch-inference-neuronx`` lists them, and the
SageMaker SDK's ``sagemaker.image_uris.retrieve("pytorch", region, ..., image_scope="inference",
instance_type="ml.inf2.xlarge")`` returns one. Pick the tag whose Neuron SDK is the one the
model was built with: the shipped compile cache records its versions, and the handler refuses
to load on a mismatch. ``TS_INSTALL_PY_DEP_PER_MODEL=true`` lets TorchServe install the
model's ``requirements-model.txt``.

``VolumeSizeInGB``: the API documents it as the size of the EBS (gp2) volume attached to
each instance. Instance types with NVMe instance storage (ml.g4dn, ml.g5, ml.p4d, ml.trn1,
...) have no such volume, SageMaker uses the instance store and rejects the parameter, so it
is left out for them. inf2 instances are EBS-only: the config's ``volume_size_gb`` is sent.

Credentials and region come from boto3's standard chain (``--region`` overrides the region).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from scripts import s3_upload
from scripts.tsctl import GOMP_SPINCOUNT, OMP_WAIT_POLICY

ROOT = Path(__file__).resolve().parent.parent

NAME_MAX = 63
NAME_RE = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
VARIANT_NAME = "AllTraffic"
# OMP_WAIT_POLICY, GOMP_SPINCOUNT: see scripts/tsctl.py (OpenMP threads that spin long starve
# TorchServe's frontend; ones that never spin pay a wake-up at every barrier).
# TS_DISABLE_TOKEN_AUTHORIZATION: SageMaker's health check sends /ping with no TorchServe key,
# which TorchServe 0.12 answers with 400 while token authorization is on; the endpoint is
# guarded by IAM instead. Set here so the endpoint comes up whether or not the container's
# toolkit already turns it off (the container reads TS_* variables: enable_envvars_config).
DEFAULT_ENV = {"TS_INSTALL_PY_DEP_PER_MODEL": "true", "OMP_WAIT_POLICY": OMP_WAIT_POLICY, "GOMP_SPINCOUNT": GOMP_SPINCOUNT,
               "TS_DISABLE_TOKEN_AUTHORIZATION": "true"}
IN_PROGRESS = ("Creating", "Updating", "SystemUpdating", "RollingBack")
# Instance families with NVMe instance storage: SageMaker rejects VolumeSizeInGB for them.
INSTANCE_STORE_FAMILIES = frozenset({
    "g4dn", "g5", "g6", "g6e", "p3dn", "p4d", "p4de", "p5", "p5e", "p5en", "trn1", "trn1n", "trn2", "dl1",
    "m5d", "c5d", "r5d", "m6gd", "c6gd", "r6gd", "r7gd", "m6id", "c6id", "r6id",
})
NEURON_CORES = {"ml.inf2.xlarge": 2, "ml.inf2.8xlarge": 2, "ml.inf2.24xlarge": 12, "ml.inf2.48xlarge": 24,
                "ml.trn1.2xlarge": 2, "ml.trn1.32xlarge": 32, "ml.trn1n.32xlarge": 32}

Request = Tuple[str, dict]  # (API operation name, parameters)


class DeployError(Exception):
    """A deployment that cannot go ahead or did not end InService."""


# ---------------------------------------------------------------------------- names


def check_name(name: str) -> str:
    if len(name) > NAME_MAX or not NAME_RE.fullmatch(name):
        raise ValueError(f"invalid SageMaker name {name!r}: at most {NAME_MAX} characters of a-z, A-Z, 0-9 and "
                         "'-', starting and ending with a letter or digit")
    return name


def default_name(config_path, now: Optional[datetime] = None) -> str:
    """``<config name>-<UTC timestamp>``, shortened and cleaned to a valid SageMaker name."""
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    base = re.sub(r"[^a-zA-Z0-9]+", "-", Path(config_path).stem).strip("-") or "model"
    base = base[:NAME_MAX - len(stamp) - 1].rstrip("-")
    return check_name(f"{base}-{stamp}")


# ---------------------------------------------------------------------------- requests


def has_instance_store(instance_type: str) -> bool:
    parts = instance_type.split(".")
    return len(parts) == 3 and parts[1] in INSTANCE_STORE_FAMILIES


def production_variant(model_name: str, sagemaker_cfg, instance_type: Optional[str] = None) -> dict:
    instance_type = instance_type or sagemaker_cfg.instance_type
    variant = {
        "VariantName": VARIANT_NAME,
        "ModelName": model_name,
        "InstanceType": instance_type,
        "InitialInstanceCount": 1,
        "ModelDataDownloadTimeoutInSeconds": sagemaker_cfg.model_data_download_timeout,
        "ContainerStartupHealthCheckTimeoutInSeconds": sagemaker_cfg.container_startup_health_check_timeout,
    }
    if not has_instance_store(instance_type):
        variant["VolumeSizeInGB"] = sagemaker_cfg.volume_size_gb
    return variant


def deploy_requests(cfg, *, name: str, s3_uri: str, role_arn: str, image_uri: str,
                    instance_type: Optional[str] = None, env: Optional[Dict[str, str]] = None) -> List[Request]:
    """The three create requests for model config ``cfg``, every resource named ``name``."""
    check_name(name)
    container = {
        "Image": image_uri,
        "ModelDataSource": s3_upload.model_data_source(s3_uri),
        "Environment": {**DEFAULT_ENV, **(env or {})},
    }
    return [
        ("CreateModel", {"ModelName": name, "ExecutionRoleArn": role_arn, "PrimaryContainer": container}),
        ("CreateEndpointConfig", {"EndpointConfigName": name,
                                  "ProductionVariants": [production_variant(name, cfg.sagemaker, instance_type)]}),
        ("CreateEndpoint", {"EndpointName": name, "EndpointConfigName": name}),
    ]


def undeploy_requests(name: str) -> List[Request]:
    check_name(name)
    return [("DeleteEndpoint", {"EndpointName": name}),
            ("DeleteEndpointConfig", {"EndpointConfigName": name}),
            ("DeleteModel", {"ModelName": name})]


def check_hardware(cfg, instance_type: str) -> List[str]:
    """Mismatches between the config and the instance that would only show after a long deployment.

    Raises DeployError for what cannot work (too few NeuronCores); returns warnings.
    """
    warnings = []
    if cfg.handler.backend == "neuron":
        if not instance_type.startswith(("ml.inf2.", "ml.trn1.", "ml.trn1n.", "ml.trn2.")):
            raise DeployError(f"the config's backend is neuron but {instance_type} has no NeuronCores; "
                              "use an ml.inf2 instance")
        cores = NEURON_CORES.get(instance_type)
        if cores is not None and cfg.handler.tp_degree > cores:
            raise DeployError(f"{instance_type} has {cores} NeuronCores, the config's handler.tp_degree is "
                              f"{cfg.handler.tp_degree}; choose a larger instance or a config built for this one")
    if cfg.handler.backend == "llamacpp":
        warnings.append("backend llamacpp needs llama-cpp-python in the serving container, and the SageMaker "
                        "TorchServe images do not have it (nor does the artifact's requirements-model.txt, since "
                        "it compiles for the host); pass an IMAGE_URI with llama-cpp-python installed")
    startup = cfg.frontend.startupTimeout
    health = cfg.sagemaker.container_startup_health_check_timeout
    if startup > health:
        warnings.append(f"TorchServe may take up to startupTimeout={startup} s to load the model, longer than "
                        f"SageMaker's container_startup_health_check_timeout={health} s")
    return warnings


def known_instance_type(instance_type: str) -> bool:
    """Whether botocore's SageMaker model lists the type (it can lag behind new instance types)."""
    import botocore.session

    shape = botocore.session.get_session().get_service_model("sagemaker").shape_for("ProductionVariantInstanceType")
    return instance_type in (shape.enum or [])


def format_request(op: str, params: dict) -> str:
    return f"{op}\n{json.dumps(params, indent=2)}"


# ---------------------------------------------------------------------------- calls


def call(sm, op: str, params: dict):
    from botocore import xform_name

    return getattr(sm, xform_name(op))(**params)


def elapsed(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


def wait_for_endpoint(sm, name: str, *, poll_interval: float = 30.0, timeout: Optional[float] = None,
                      out=None, clock: Callable[[], float] = time.monotonic,
                      sleep: Callable[[float], None] = time.sleep) -> dict:
    """Poll DescribeEndpoint until the endpoint leaves the in-progress states; print each change."""
    out = out or sys.stdout
    started = clock()
    last = None
    while True:
        description = sm.describe_endpoint(EndpointName=name)
        status = description["EndpointStatus"]
        spent = clock() - started
        if status != last:
            print(f"  [{elapsed(spent)}] {status}", file=out, flush=True)
            last = status
        if status not in IN_PROGRESS:
            return description
        if timeout is not None and spent >= timeout:
            raise DeployError(f"endpoint {name} still {status} after {elapsed(spent)}; it goes on being created "
                              "(check it in the console, or undeploy it)")
        sleep(poll_interval)


def deploy(sm, requests: List[Request], *, wait: bool = True, poll_interval: float = 30.0,
           timeout: Optional[float] = None, out=None) -> Optional[dict]:
    """Send the create requests in order, then wait for InService (unless ``wait`` is false).

    Returns the last DescribeEndpoint (None without waiting). Raises DeployError when the
    endpoint fails, naming SageMaker's FailureReason and what to undeploy; a ClientError
    from a create call propagates after saying which resources exist.
    """
    from botocore.exceptions import ClientError

    out = out or sys.stdout
    created = []
    for op, params in requests:
        what = f"{op[len('Create'):]} {next(iter(params.values()))}"
        try:
            call(sm, op, params)
        except ClientError:
            print(f"{op} failed; created before it: {', '.join(created) or 'nothing'}", file=sys.stderr)
            raise
        created.append(what)
        print(f"created {what}", file=out, flush=True)
    name = requests[-1][1]["EndpointName"]
    if not wait:
        print(f"endpoint {name} is being created; not waiting (--no-wait)", file=out)
        return None
    print(f"waiting for endpoint {name} to be InService (logs: CloudWatch group /aws/sagemaker/Endpoints/{name})",
          file=out, flush=True)
    description = wait_for_endpoint(sm, name, poll_interval=poll_interval, timeout=timeout, out=out)
    if description["EndpointStatus"] != "InService":
        reason = description.get("FailureReason", "no FailureReason given")
        raise DeployError(f"endpoint {name} is {description['EndpointStatus']}: {reason}")
    return description


def _is_missing(exc) -> bool:
    error = exc.response.get("Error", {})
    return error.get("Code") == "ValidationException" and "could not find" in error.get("Message", "").lower()


def undeploy(sm, name: str, *, out=None) -> Dict[str, str]:
    """Delete the endpoint, endpoint config and model called ``name``; a missing one is not an error."""
    from botocore.exceptions import ClientError

    out = out or sys.stdout
    results = {}
    for op, params in undeploy_requests(name):
        what = op[len("Delete"):]
        try:
            call(sm, op, params)
            results[what] = "deleted"
        except ClientError as exc:
            if not _is_missing(exc):
                raise
            results[what] = "not found (already gone)"
        print(f"  {what} {name}: {results[what]}", file=out, flush=True)
    return results


# ---------------------------------------------------------------------------- CLI


def make_client(region: Optional[str] = None):
    import boto3

    return boto3.session.Session(region_name=region).client("sagemaker")


def parse_env(pairs: List[str]) -> Dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", key):
            raise ValueError(f"--env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    dep = sub.add_parser("deploy", help="create the model, endpoint config and endpoint; wait for InService")
    dep.add_argument("--config", required=True, type=Path, help="model-config YAML (its sagemaker: section sizes it)")
    dep.add_argument("--s3-uri", required=True, help="s3://bucket/prefix/ holding the uploaded model directory")
    dep.add_argument("--role-arn", required=True,
                     help="SageMaker execution role (reads the S3 prefix, pulls the image)")
    dep.add_argument("--image-uri", required=True, help="PyTorch Neuronx inference container image (see above)")
    dep.add_argument("--name", help="name of all three resources (default: config name + UTC timestamp)")
    dep.add_argument("--region", help="AWS region (default: boto3's configuration)")
    dep.add_argument("--instance-type", help="override the config's sagemaker.instance_type")
    dep.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                     help="extra container environment (repeatable)")
    dep.add_argument("--dry-run", action="store_true", help="print the requests; send nothing")
    dep.add_argument("--no-wait", action="store_true", help="return once CreateEndpoint is accepted")
    dep.add_argument("--poll-interval", type=float, default=30.0, help="seconds between status checks (default 30)")
    dep.add_argument("--timeout", type=float,
                     help="give up waiting after this many seconds (default: the config's download and startup "
                          "timeouts plus 30 minutes for provisioning)")
    und = sub.add_parser("undeploy", help="delete the endpoint, endpoint config and model of a name")
    und.add_argument("--name", required=True, help="the name deploy gave the three resources")
    und.add_argument("--region", help="AWS region (default: boto3's configuration)")
    und.add_argument("--dry-run", action="store_true", help="print the requests; send nothing")
    return parser


def _deploy_plan(args, parser) -> Tuple[List[Request], object]:
    from llama_engine.config import ConfigError, load_model_config_file

    try:
        cfg = load_model_config_file(str(args.config))
        name = check_name(args.name) if args.name else default_name(args.config)
        instance_type = args.instance_type or cfg.sagemaker.instance_type
        for warning in check_hardware(cfg, instance_type):
            print(f"warning: {warning}", file=sys.stderr)
        if not known_instance_type(instance_type):
            print(f"warning: {instance_type} is not in botocore's list of endpoint instance types", file=sys.stderr)
        requests = deploy_requests(cfg, name=name, s3_uri=args.s3_uri, role_arn=args.role_arn,
                                   image_uri=args.image_uri, instance_type=args.instance_type,
                                   env=parse_env(args.env))
    except (ConfigError, ValueError, DeployError, OSError) as exc:
        parser.error(str(exc))
    return requests, cfg


def _wait_timeout(args, cfg) -> float:
    if args.timeout is not None:
        return args.timeout
    return cfg.sagemaker.model_data_download_timeout + cfg.sagemaker.container_startup_health_check_timeout + 1800


def main(argv=None, *, client=None) -> int:
    """``client``: a SageMaker client to use instead of one from boto3's chain (tests)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cmd == "deploy":
        requests, cfg = _deploy_plan(args, parser)
    else:
        try:
            requests = undeploy_requests(args.name)
        except ValueError as exc:
            parser.error(str(exc))
    if args.dry_run:
        for op, params in requests:
            print(format_request(op, params))
        print("dry run: nothing was sent")
        return 0

    from botocore.exceptions import BotoCoreError, ClientError

    name = next(iter(requests[0][1].values()))
    cleanup = f"remove what was created with: python scripts/sagemaker_deploy.py undeploy --name {name}"
    try:
        sm = client or make_client(args.region)
        if args.cmd == "undeploy":
            print(f"undeploying {name}:")
            undeploy(sm, name)
            return 0
        description = deploy(sm, requests, wait=not args.no_wait, poll_interval=args.poll_interval,
                             timeout=_wait_timeout(args, cfg))
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        print(f"the resources are left for inspection; {cleanup}", file=sys.stderr)
        return 1
    except (BotoCoreError, ClientError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        if args.cmd == "deploy":
            print(cleanup, file=sys.stderr)
        return 1
    if description is not None:
        print(f"endpoint {name} is InService ({description.get('EndpointArn', '')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
