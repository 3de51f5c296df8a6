"""scripts/s3_upload.py against a real S3-compatible server (moto) on loopback."""
from __future__ import annotations

import base64
import filecmp
import hashlib
import os
from pathlib import Path

import boto3
import pytest

from scripts import s3_upload

from s3_server import fake_aws_credentials, moto_s3_server, new_bucket

MiB = 1024 * 1024
PREFIX = "models/tiny/"
MUTATING = ("PutObject", "CreateMultipartUpload", "UploadPart", "CompleteMultipartUpload", "DeleteObjects",
            "AbortMultipartUpload", "DeleteObject")
SENDS = ("PutObject", "CreateMultipartUpload")


@pytest.fixture(scope="module")
def endpoint():
    with moto_s3_server() as url:
        yield url


@pytest.fixture
def s3(endpoint, monkeypatch, tmp_path):
    fake_aws_credentials(monkeypatch, tmp_path)
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")


@pytest.fixture
def bucket(s3):
    return new_bucket(s3)


@pytest.fixture
def uri(bucket):
    return f"s3://{bucket}/{PREFIX}"


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A small model tree; model/weights.bin is over the 5 MiB multipart threshold (2 parts)."""
    root = tmp_path / "tiny"
    write(root / "MAR-INF" / "MANIFEST.json", b'{"model": {"modelName": "tiny"}}')
    write(root / "handler.py", b"def handle(data, context):\n    return data\n")
    write(root / "model" / "config.json", b'{"model_type": "llama", "hidden_size": 64}')
    write(root / "model" / "weights.bin", os.urandom(6 * MiB + 123))
    write(root / "model" / "nested" / "empty.txt", b"")
    write(root / "llama_engine" / "__pycache__" / "x.cpython-311.pyc", b"bytecode")  # never uploaded
    return root


RELS = ["MAR-INF/MANIFEST.json", "handler.py", "model/config.json", "model/nested/empty.txt", "model/weights.bin"]


@pytest.fixture
def config():
    return s3_upload.make_transfer_config(concurrency=4, multipart_threshold_mb=5)


class Calls:
    """Records the parameters of every S3 call the client makes, by operation."""

    def __init__(self, s3):
        self.calls = []
        s3.meta.events.register("before-parameter-build.s3", self._record)

    def _record(self, params, model, **kwargs):
        self.calls.append((model.name, dict(params)))

    def of(self, *ops):
        return [params for op, params in self.calls if op in ops]

    def keys(self, *ops):
        return sorted(params["Key"] for params in self.of(*ops))


def run_sync(model_dir, uri, s3, config, **kwargs):
    return s3_upload.sync(model_dir, uri, s3, transfer_config=config, progress=False, **kwargs)


def remote_keys(s3, bucket):
    return sorted(s3_upload.list_remote(s3, bucket, PREFIX))


def test_upload_then_rerun_sends_nothing(model_dir, uri, s3, bucket, config):
    calls = Calls(s3)
    report = run_sync(model_dir, uri, s3, config)
    assert report.ok, report.problems
    assert report.uploaded == RELS and report.skipped == []
    assert report.bytes_sent == sum((model_dir / r).stat().st_size for r in RELS)
    assert remote_keys(s3, bucket) == [PREFIX + r for r in RELS]
    assert calls.keys("CreateMultipartUpload") == [PREFIX + "model/weights.bin"]
    assert len(calls.of("UploadPart")) == 2
    assert all(p["ChecksumAlgorithm"] == "SHA256" for p in calls.of("PutObject", "CreateMultipartUpload"))
    sha = hashlib.sha256((model_dir / "handler.py").read_bytes()).hexdigest()
    assert s3.head_object(Bucket=bucket, Key=PREFIX + "handler.py")["Metadata"] == {"sha256": sha}

    calls.calls.clear()
    again = run_sync(model_dir, uri, s3, config)
    assert again.ok and again.uploaded == [] and again.skipped == RELS and again.bytes_sent == 0
    assert calls.of(*MUTATING) == []


def test_only_the_changed_file_is_sent(model_dir, uri, s3, config):
    run_sync(model_dir, uri, s3, config)
    handler = model_dir / "handler.py"
    handler.write_bytes(handler.read_bytes().replace(b"data\n", b"None\n"))  # same size, other bytes
    write(model_dir / "model" / "config.json", b'{"model_type": "llama"}')  # other size
    calls = Calls(s3)
    report = run_sync(model_dir, uri, s3, config)
    assert report.ok and report.uploaded == ["handler.py", "model/config.json"]
    assert calls.keys(*SENDS) == [PREFIX + "handler.py", PREFIX + "model/config.json"]
    assert calls.of("UploadPart") == []


def test_interrupted_upload_resumes_without_resending_what_arrived(model_dir, uri, s3, bucket):
    config = s3_upload.make_transfer_config(concurrency=1, multipart_threshold_mb=5)
    sent = []

    def cut_the_line(params, **kwargs):
        if len(sent) >= 2:
            raise ConnectionError("network cut")
        sent.append(params["Key"])

    s3.meta.events.register("before-parameter-build.s3.PutObject", cut_the_line)
    with pytest.raises(s3_upload.SyncError, match="were not uploaded.*run again") as info:
        run_sync(model_dir, uri, s3, config)
    s3.meta.events.unregister("before-parameter-build.s3.PutObject", cut_the_line)
    arrived = remote_keys(s3, bucket)
    missing = sorted(set(PREFIX + r for r in RELS) - set(arrived))
    assert set(sent) <= set(arrived) and len(sent) == 2 and missing
    for key in missing:
        assert f"{key[len(PREFIX):]}: network cut" in str(info.value)

    calls = Calls(s3)
    report = run_sync(model_dir, uri, s3, config)
    assert report.ok
    assert sorted(PREFIX + r for r in report.skipped) == arrived
    assert calls.keys(*SENDS) == missing
    assert remote_keys(s3, bucket) == [PREFIX + r for r in RELS]


def test_incomplete_multipart_uploads_under_the_prefix_are_aborted(model_dir, uri, s3, bucket, config):
    key = PREFIX + "model/weights.bin"
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256")
    s3.upload_part(Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * (5 * MiB),
                   ChecksumAlgorithm="SHA256")
    other = s3.create_multipart_upload(Bucket=bucket, Key="elsewhere/file")

    dry = run_sync(model_dir, uri, s3, config, dry_run=True)
    assert dry.aborted == [key]
    assert len(s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 2

    report = run_sync(model_dir, uri, s3, config)
    assert report.ok and report.aborted == [key]
    left = s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [(u["Key"], u["UploadId"]) for u in left] == [("elsewhere/file", other["UploadId"])]


def test_verify_names_every_tampered_object(model_dir, uri, s3, bucket, config):
    run_sync(model_dir, uri, s3, config)
    handler = (model_dir / "handler.py").read_bytes()
    s3.put_object(Bucket=bucket, Key=PREFIX + "handler.py", Body=handler.upper(), ChecksumAlgorithm="SHA256")
    cfg = (model_dir / "model" / "config.json").read_bytes()
    s3.put_object(Bucket=bucket, Key=PREFIX + "model/config.json", Body=cfg.upper())  # CRC32 only
    other = model_dir.parent / "other-weights.bin"
    other.write_bytes(os.urandom((model_dir / "model" / "weights.bin").stat().st_size))
    s3.upload_file(str(other), bucket, PREFIX + "model/weights.bin", Config=config,
                   ExtraArgs={"ChecksumAlgorithm": "SHA256"})

    problems = s3_upload.verify(model_dir, bucket, PREFIX, s3)
    assert len(problems) == 3
    assert problems[0].startswith(f"s3://{bucket}/{PREFIX}handler.py: SHA-256 checksum differs")
    assert problems[1].startswith(f"s3://{bucket}/{PREFIX}model/config.json: no SHA-256 checksum")
    assert problems[2].startswith(f"s3://{bucket}/{PREFIX}model/weights.bin: SHA-256 checksum differs")
    assert problems[2].endswith("-2)")

    s3.delete_object(Bucket=bucket, Key=PREFIX + "MAR-INF/MANIFEST.json")
    assert f"s3://{bucket}/{PREFIX}MAR-INF/MANIFEST.json: missing" in s3_upload.verify(model_dir, bucket, PREFIX, s3)


def test_cli_exits_non_zero_naming_an_object_corrupted_after_upload(model_dir, uri, s3, bucket, endpoint,
                                                                     monkeypatch, capsys):
    real_upload = s3_upload.upload_files

    def upload_then_corrupt(client, plan, **kwargs):
        sent = real_upload(client, plan, **kwargs)
        client.put_object(Bucket=bucket, Key=PREFIX + "model/config.json", Body=b"{}", ChecksumAlgorithm="SHA256")
        return sent

    monkeypatch.setattr(s3_upload, "upload_files", upload_then_corrupt)
    rc = s3_upload.main([str(model_dir), uri, "--endpoint-url", endpoint, "--multipart-threshold-mb", "5",
                         "--no-progress"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "VERIFICATION FAILED for 1 objects" in err
    assert f"s3://{bucket}/{PREFIX}model/config.json: size differs" in err
    assert "S3DataSource" not in out


def test_delete_removes_stale_objects_and_dry_run_sends_nothing(model_dir, uri, s3, bucket, config):
    run_sync(model_dir, uri, s3, config)
    (model_dir / "handler.py").unlink()
    write(model_dir / "model" / "added.json", b"{}")
    before = {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}

    calls = Calls(s3)
    dry = run_sync(model_dir, uri, s3, config, dry_run=True, delete=True)
    assert dry.dry_run and dry.uploaded == ["model/added.json"] and dry.deleted == [PREFIX + "handler.py"]
    assert calls.of(*MUTATING) == []
    assert {o["Key"]: o["ETag"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]} == before

    kept = run_sync(model_dir, uri, s3, config)
    assert kept.deleted == [] and kept.stale == [PREFIX + "handler.py"]
    assert PREFIX + "handler.py" in remote_keys(s3, bucket)

    report = run_sync(model_dir, uri, s3, config, delete=True)
    assert report.ok and report.deleted == [PREFIX + "handler.py"] and report.uploaded == []
    expected = sorted(PREFIX + r for r in RELS if r != "handler.py") + [PREFIX + "model/added.json"]
    assert remote_keys(s3, bucket) == sorted(expected)


def test_cli_dry_run_lists_and_sends_nothing(model_dir, uri, s3, bucket, endpoint, capsys):
    rc = s3_upload.main([str(model_dir), uri, "--endpoint-url", endpoint, "--dry-run", "--delete"])
    out, _ = capsys.readouterr()
    assert rc == 0
    assert "would send    model/weights.bin (6.0 MiB; new)" in out
    assert "dry run: nothing was sent" in out
    assert remote_keys(s3, bucket) == []


def test_encryption_arguments_are_sent_and_a_change_re_sends(model_dir, uri, s3, bucket, config):
    calls = Calls(s3)
    report = run_sync(model_dir, uri, s3, config, sse="aws:kms", kms_key_id="alias/model-key")
    assert report.ok
    creates = calls.of("PutObject", "CreateMultipartUpload")
    assert len(creates) == len(RELS)
    assert all(p["ServerSideEncryption"] == "aws:kms" and p["SSEKMSKeyId"] == "alias/model-key" for p in creates)
    assert s3.head_object(Bucket=bucket, Key=PREFIX + "handler.py")["ServerSideEncryption"] == "aws:kms"

    calls.calls.clear()
    again = run_sync(model_dir, uri, s3, config, sse="AES256")
    assert again.uploaded == RELS  # same bytes, other encryption: sent again
    creates = calls.of("PutObject", "CreateMultipartUpload")
    assert all(p["ServerSideEncryption"] == "AES256" and "SSEKMSKeyId" not in p for p in creates)
    assert run_sync(model_dir, uri, s3, config, sse="AES256").uploaded == []


def test_kms_key_without_aws_kms_is_refused(model_dir, uri, s3, config, capsys):
    with pytest.raises(ValueError, match="needs --sse aws:kms"):
        run_sync(model_dir, uri, s3, config, kms_key_id="alias/k")
    with pytest.raises(ValueError, match="needs --sse aws:kms"):
        run_sync(model_dir, uri, s3, config, sse="AES256", kms_key_id="alias/k")
    with pytest.raises(SystemExit) as info:
        s3_upload.main([str(model_dir), uri, "--sse-kms-key-id", "alias/k"])
    assert info.value.code == 2
    assert "needs --sse aws:kms" in capsys.readouterr().err


def test_multipart_object_carries_the_composite_sha256_of_its_parts(model_dir, uri, s3, bucket, config):
    assert run_sync(model_dir, uri, s3, config).ok
    data = (model_dir / "model" / "weights.bin").read_bytes()
    parts = [data[:5 * MiB], data[5 * MiB:]]
    composite = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in parts)).digest()
    expected = base64.b64encode(composite).decode() + "-2"

    remote = s3_upload.describe_remote(s3, bucket, PREFIX + "model/weights.bin")
    assert (remote.parts, remote.part_size, remote.size) == (2, 5 * MiB, len(data))
    assert remote.checksum.split("-")[0] == expected.split("-")[0]
    assert s3_upload.hash_file(model_dir / "model" / "weights.bin", 5 * MiB).s3_checksum == expected
    whole = s3_upload.hash_file(model_dir / "model" / "weights.bin")
    assert whole.sha256_hex == hashlib.sha256(data).hexdigest()
    assert remote.meta_sha256 == whole.sha256_hex


def test_download_round_trips_the_tree(model_dir, uri, s3, bucket, config, tmp_path):
    run_sync(model_dir, uri, s3, config)
    s3.put_object(Bucket=bucket, Key=PREFIX + "model/", Body=b"")  # a console-made "folder"
    s3.put_object(Bucket=bucket, Key=PREFIX + "extra.txt", Body=b"by hand")  # no SHA-256: checked by size
    write(model_dir / "extra.txt", b"by hand")
    out = tmp_path / "opt-ml-model"
    paths = s3_upload.download(uri, out, s3, transfer_config=config)
    assert sorted(p.relative_to(out).as_posix() for p in paths) == sorted(RELS + ["extra.txt"])
    for rel in RELS + ["extra.txt"]:
        assert filecmp.cmp(model_dir / rel, out / rel, shallow=False), rel


def test_download_refuses_keys_that_escape_the_directory(uri, s3, bucket, tmp_path):
    s3.put_object(Bucket=bucket, Key=PREFIX + "../escape", Body=b"x")
    with pytest.raises(s3_upload.SyncError, match="refusing to download"):
        s3_upload.download(uri, tmp_path / "out", s3)


def test_cli_prints_the_exact_model_data_source_block(model_dir, bucket, s3, endpoint, capsys):
    rc = s3_upload.main([str(model_dir), f"s3://{bucket}/models/tiny", "--endpoint-url", endpoint,
                         "--multipart-threshold-mb", "5", "--no-progress"])
    out, _ = capsys.readouterr()
    assert rc == 0
    u = f"s3://{bucket}/models/tiny/"
    block = (
        f"model uploaded to {u}\n"
        "\n"
        'boto3, sagemaker.create_model(PrimaryContainer={..., "ModelDataSource": <this>}):\n'
        "{\n"
        '  "S3DataSource": {\n'
        f'    "S3Uri": "{u}",\n'
        '    "S3DataType": "S3Prefix",\n'
        '    "CompressionType": "None"\n'
        "  }\n"
        "}\n"
        "\n"
        "SageMaker Python SDK, sagemaker.model.Model(model_data=<this>, ...):\n"
        f'model_data={{"S3DataSource": {{"S3Uri": "{u}", "S3DataType": "S3Prefix", "CompressionType": "None"}}}}\n'
    )
    assert out.endswith(block)
    assert "verified 5 objects by SHA-256" in out


def test_s3_uri_parsing_and_model_data_source():
    assert s3_upload.parse_s3_uri("s3://b-1/a/b") == ("b-1", "a/b/")
    assert s3_upload.parse_s3_uri("s3://b-1/a/b/") == ("b-1", "a/b/")
    for bad in ("https://b/a/", "s3://", "s3://bucket", "s3://bucket/"):
        with pytest.raises(ValueError):
            s3_upload.parse_s3_uri(bad)
    assert s3_upload.model_data_source("s3://b-1/m") == {
        "S3DataSource": {"S3Uri": "s3://b-1/m/", "S3DataType": "S3Prefix", "CompressionType": "None"}}


def test_the_real_model_store_directory_uploads_and_verifies(uri, s3, bucket, config, tiny_model_dir, tmp_path):
    """The archive `make build` writes (built here into a temporary store when it is not there)."""
    root = Path(__file__).resolve().parents[2]
    store = root / "model_store" / "tiny-llama"
    if not (store / "MAR-INF" / "MANIFEST.json").exists():
        from scripts import build_model

        build_model.main(["--config", str(root / "model-config" / "tiny-llama.yaml"), "--checkpoint",
                          str(tiny_model_dir), "--build-dir", str(tmp_path / "build"),
                          "--export-path", str(tmp_path / "store")])
        store = tmp_path / "store" / "tiny-llama"
    report = run_sync(store, uri, s3, config)
    assert report.ok and report.uploaded
    assert s3_upload.verify(store, bucket, PREFIX, s3) == []
