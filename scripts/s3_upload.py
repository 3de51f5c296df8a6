#!/usr/bin/env python3
"""Upload a built model directory, uncompressed, under an S3 prefix for SageMaker.

    python scripts/s3_upload.py model_store/llama-2-13b-inf2-24xlarge-b1 s3://my-bucket/llama-2-13b-b1/

SageMaker's uncompressed model artifacts (``S3DataType: S3Prefix``, ``CompressionType:
None``) download every object under the prefix into ``/opt/ml/model``, which skips the
tar.gz step that costs minutes for a 26 GB model. At the end the script prints the
``ModelDataSource`` block for boto3 and the SageMaker Python SDK.

Sync semantics. A file whose object already exists with the same size and the same SHA-256
checksum is skipped; anything else is sent. An interrupted upload therefore resumes at file
granularity when run again: what arrived is skipped, the rest is sent (a file cut off in the
middle is sent again from its start). A killed run can leave incomplete multipart uploads
behind, which S3 keeps and bills until aborted; every run aborts the ones under the prefix
before it sends anything, so do not run two uploads to the same prefix at once (a lifecycle
rule with ``AbortIncompleteMultipartUpload`` on the bucket is a good second safeguard).
``--delete`` removes objects under the prefix that no longer exist locally: SageMaker would
download them too. ``--dry-run`` lists what would be sent, skipped, deleted and aborted, and
changes nothing. Python byte-code (``__pycache__``, ``*.pyc``) is never uploaded.

Verification. Every file is sent with ``ChecksumAlgorithm=SHA256``: S3 checks the checksum
of every PUT and every part on arrival and keeps it. After the upload, every object under
the prefix that belongs to a local file is checked with ``HeadObject(ChecksumMode=ENABLED)``
against a checksum computed locally, and any difference fails the run naming each key:

* a single PUT carries the SHA-256 of the file (base64);
* a multipart upload carries a composite "checksum of checksums": the SHA-256 of the
  concatenated binary SHA-256s of the parts, with ``-N`` (the part count) appended. The part
  count comes from the object's ETag suffix and the part size from ``HeadObject(PartNumber=1)``,
  so the local side is recomputed with the layout the object really has, whatever part size
  the uploader chose.

SHA-256 rather than the ETag: an ETag is an MD5 of the content only for objects without
SSE-KMS, so it could not verify KMS-encrypted uploads, and MD5 is the weaker hash. The full-file SHA-256 (hex) is
also stored as ``x-amz-meta-sha256`` for tools that want one value per file; it is checked
when present. moto (the S3 server of the tests) stores and returns these checksums, but its
HeadObject leaves out the ``-N`` suffix of composite checksums; the comparison accepts a
value with or without it and takes the part count from the ETag.

Credentials come from boto3's standard chain only (environment, shared config/SSO, instance
or container role); the script takes no credential arguments and never prints any.
"""
from __future__ import annotations

import argparse
import base64
import concurrent.futures
import hashlib
import json
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

MiB = 1024 * 1024
CHECKSUM_ALGORITHM = "SHA256"
META_SHA256 = "sha256"
SSE_CHOICES = ("AES256", "aws:kms")
READ_BLOCK = 1 * MiB
HEAD_WORKERS = 16
SKIP_DIRS = ("__pycache__",)
SKIP_SUFFIXES = (".pyc",)


class SyncError(Exception):
    """An upload or a download that did not complete; the message names the files."""


# ---------------------------------------------------------------------------- addresses


def parse_s3_uri(uri: str) -> Tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")``.

    The prefix always ends in "/" (SageMaker's S3Prefix needs it, and without it
    ``models/a`` would also match ``models/ab/...``). The bucket root is refused: ``--delete``
    there would empty the bucket.
    """
    if not uri.startswith("s3://"):
        raise ValueError(f"not an S3 URI (expected s3://bucket/prefix/): {uri!r}")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    prefix = prefix.strip("/")
    if not prefix:
        raise ValueError(f"{uri!r} has no key prefix; upload a model under one, e.g. s3://{bucket}/my-model/")
    return bucket, prefix + "/"


def _as_prefix(prefix: str) -> str:
    return prefix if prefix.endswith("/") else prefix + "/"


def format_s3_uri(bucket: str, prefix: str) -> str:
    return f"s3://{bucket}/{prefix}"


def model_data_source(uri: str) -> dict:
    """The ``ModelDataSource`` of a CreateModel container for an uncompressed model under ``uri``."""
    bucket, prefix = parse_s3_uri(uri)
    return {"S3DataSource": {"S3Uri": format_s3_uri(bucket, prefix), "S3DataType": "S3Prefix",
                             "CompressionType": "None"}}


def model_data_block(uri: str) -> str:
    """What the CLI prints at the end: the URI, the boto3 block and the SDK's ``model_data=``."""
    source = model_data_source(uri)
    return "\n".join([
        f"model uploaded to {source['S3DataSource']['S3Uri']}",
        "",
        "boto3, sagemaker.create_model(PrimaryContainer={..., \"ModelDataSource\": <this>}):",
        json.dumps(source, indent=2),
        "",
        "SageMaker Python SDK, sagemaker.model.Model(model_data=<this>, ...):",
        f"model_data={json.dumps(source)}",
    ])


# ---------------------------------------------------------------------------- checksums


def make_transfer_config(concurrency: int = 8, multipart_threshold_mb: int = 64,
                         chunk_mb: Optional[int] = None):
    """The transfer settings; the classic (Python) transfer manager, whose part size is the chunk size."""
    from boto3.s3.transfer import TransferConfig

    chunk = (chunk_mb or multipart_threshold_mb) * MiB
    return TransferConfig(multipart_threshold=multipart_threshold_mb * MiB, multipart_chunksize=chunk,
                          max_concurrency=concurrency, preferred_transfer_client="classic")


def upload_part_size(size: int, config) -> Optional[int]:
    """The part size s3transfer uses for a file of ``size`` bytes; None for a single PUT."""
    from s3transfer.utils import ChunksizeAdjuster

    if size < config.multipart_threshold:
        return None
    return ChunksizeAdjuster().adjust_chunksize(config.multipart_chunksize, size)


@dataclass(frozen=True)
class FileHash:
    sha256_hex: str                 # of the whole file
    s3_checksum: str                # what S3 reports: base64 SHA-256, or composite + "-N"
    part_size: Optional[int]


def hash_file(path: Path, part_size: Optional[int] = None) -> FileHash:
    """One pass over the file: its SHA-256 and, for a multipart layout, the composite checksum."""
    whole = hashlib.sha256()
    parts: List[bytes] = []
    part = hashlib.sha256()
    in_part = 0
    with open(path, "rb") as f:
        while True:
            want = READ_BLOCK if part_size is None else min(READ_BLOCK, part_size - in_part)
            block = f.read(want)
            if not block:
                break
            whole.update(block)
            if part_size is not None:
                part.update(block)
                in_part += len(block)
                if in_part == part_size:
                    parts.append(part.digest())
                    part, in_part = hashlib.sha256(), 0
    if part_size is None:
        return FileHash(whole.hexdigest(), _b64(whole.digest()), None)
    if in_part or not parts:
        parts.append(part.digest())
    composite = _b64(hashlib.sha256(b"".join(parts)).digest())
    return FileHash(whole.hexdigest(), f"{composite}-{len(parts)}", part_size)


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode("ascii")


class Hasher:
    """Hashes each (file, part size) once per run: planning, uploading and verifying share it."""

    def __init__(self):
        self._cache: Dict[Tuple[str, Optional[int]], FileHash] = {}
        self._lock = threading.Lock()

    def get(self, path: Path, part_size: Optional[int] = None) -> FileHash:
        key = (str(path), part_size)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        result = hash_file(path, part_size)
        with self._lock:
            self._cache[key] = result
        return result


# ---------------------------------------------------------------------------- local and remote


@dataclass(frozen=True)
class LocalFile:
    rel: str          # posix path relative to the model directory, also the key suffix
    path: Path
    size: int


def local_files(local_dir: Path) -> List[LocalFile]:
    """Every regular file under ``local_dir``, symlinks followed (build steps link the weights).

    Python byte-code (``__pycache__``, ``*.pyc``) is left out: a server started from the model
    store writes it there, and it belongs to that host's Python, not to the model.
    """
    root = Path(local_dir)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory")
    files = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.is_file() and not name.endswith(SKIP_SUFFIXES):
                files.append(LocalFile(path.relative_to(root).as_posix(), path, path.stat().st_size))
    return sorted(files, key=lambda f: f.rel)


@dataclass(frozen=True)
class RemoteObject:
    key: str
    size: int
    checksum: Optional[str]          # ChecksumSHA256 as S3 reports it
    parts: int                       # 0 for a single PUT
    part_size: Optional[int]
    sse: Optional[str]
    meta_sha256: Optional[str]


def _is_not_found(exc) -> bool:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code")
    return code in ("404", "NoSuchKey", "NotFound")


def describe_remote(s3, bucket: str, key: str) -> Optional[RemoteObject]:
    """HeadObject with checksums, and the object's part layout; None if there is no object."""
    from botocore.exceptions import ClientError

    try:
        head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    except ClientError as exc:
        if _is_not_found(exc):
            return None
        raise
    size = head["ContentLength"]
    etag = head.get("ETag", "").strip('"')
    parts = int(etag.rsplit("-", 1)[1]) if "-" in etag else 0
    part_size = None
    if parts == 1:
        part_size = size
    elif parts > 1:
        part_size = s3.head_object(Bucket=bucket, Key=key, PartNumber=1)["ContentLength"]
    return RemoteObject(key, size, head.get("ChecksumSHA256"), parts, part_size,
                        head.get("ServerSideEncryption"), head.get("Metadata", {}).get(META_SHA256))


def compare(local: LocalFile, remote: Optional[RemoteObject], hasher: Hasher,
            require_checksum: bool = True) -> Optional[str]:
    """None when the object holds exactly the local file's bytes, else what differs.

    Without ``require_checksum`` an object that has no SHA-256 checksum passes on its size.
    """
    if remote is None:
        return "missing"
    if remote.size != local.size:
        return f"size differs (S3 {remote.size} B, local {local.size} B)"
    if not remote.checksum:
        return "no SHA-256 checksum on the object (not uploaded by this tool?)" if require_checksum else None
    mine = hasher.get(local.path, remote.part_size if remote.parts else None)
    theirs = remote.checksum
    if remote.parts and "-" not in theirs:  # moto leaves the part count out
        theirs = f"{theirs}-{remote.parts}"
    if theirs != mine.s3_checksum:
        return f"SHA-256 checksum differs (S3 {theirs}, local {mine.s3_checksum})"
    if remote.meta_sha256 is not None and remote.meta_sha256 != mine.sha256_hex:
        return f"x-amz-meta-{META_SHA256} differs from the file's SHA-256"
    return None


def list_remote(s3, bucket: str, prefix: str) -> Dict[str, int]:
    sizes = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            sizes[obj["Key"]] = obj["Size"]
    return sizes


def incomplete_uploads(s3, bucket: str, prefix: str) -> List[Tuple[str, str]]:
    uploads = []
    for page in s3.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        uploads += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
    return uploads


# ---------------------------------------------------------------------------- plan


@dataclass
class Plan:
    bucket: str
    prefix: str
    upload: List[Tuple[LocalFile, str]] = field(default_factory=list)   # (file, reason)
    skip: List[LocalFile] = field(default_factory=list)
    delete: List[str] = field(default_factory=list)                     # keys not present locally
    abort: List[Tuple[str, str]] = field(default_factory=list)          # (key, upload id)

    @property
    def bytes_to_send(self) -> int:
        return sum(f.size for f, _ in self.upload)

    def key(self, rel: str) -> str:
        return self.prefix + rel


def _needs_upload(local, remote, hasher, sse) -> Optional[str]:
    if remote is None:
        return "new"
    problem = compare(local, remote, hasher)
    if problem:
        return problem
    if sse and remote.sse != sse:
        return f"encryption differs (S3 {remote.sse or 'none'}, asked {sse})"
    return None


def plan_sync(local_dir, bucket: str, prefix: str, s3, *, sse: Optional[str] = None,
              hasher: Optional[Hasher] = None, workers: int = HEAD_WORKERS) -> Plan:
    """What a sync of ``local_dir`` to ``s3://bucket/prefix`` has to do; changes nothing."""
    hasher = hasher or Hasher()
    prefix = _as_prefix(prefix)
    files = local_files(Path(local_dir))
    remote = list_remote(s3, bucket, prefix)
    plan = Plan(bucket, prefix)

    def decide(local: LocalFile) -> Optional[str]:
        key = plan.key(local.rel)
        if key not in remote:
            return "new"
        if remote[key] != local.size:
            return f"size differs (S3 {remote[key]} B, local {local.size} B)"
        return _needs_upload(local, describe_remote(s3, bucket, key), hasher, sse)

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        reasons = list(pool.map(decide, files))
    for local, reason in zip(files, reasons):
        if reason:
            plan.upload.append((local, reason))
        else:
            plan.skip.append(local)
    wanted = {plan.key(f.rel) for f in files}
    plan.delete = sorted(k for k in remote if k not in wanted)
    plan.abort = incomplete_uploads(s3, bucket, prefix)
    return plan


# ---------------------------------------------------------------------------- sync


@dataclass
class Report:
    uri: str
    dry_run: bool
    uploaded: List[str] = field(default_factory=list)     # relative paths
    skipped: List[str] = field(default_factory=list)
    deleted: List[str] = field(default_factory=list)      # keys
    aborted: List[str] = field(default_factory=list)      # keys of incomplete multipart uploads
    stale: List[str] = field(default_factory=list)        # keys not local, left in place (no --delete)
    bytes_sent: int = 0
    problems: List[str] = field(default_factory=list)     # verification failures, one per key

    @property
    def ok(self) -> bool:
        return not self.problems


def check_sse(sse: Optional[str], kms_key_id: Optional[str]) -> None:
    if sse is not None and sse not in SSE_CHOICES:
        raise ValueError(f"--sse must be one of {', '.join(SSE_CHOICES)}, got {sse!r}")
    if kms_key_id and sse != "aws:kms":
        raise ValueError("--sse-kms-key-id needs --sse aws:kms (a KMS key only applies to SSE-KMS)")


def extra_args(sse: Optional[str], kms_key_id: Optional[str], sha256_hex: str) -> dict:
    args = {"ChecksumAlgorithm": CHECKSUM_ALGORITHM, "Metadata": {META_SHA256: sha256_hex}}
    if sse:
        args["ServerSideEncryption"] = sse
    if kms_key_id:
        args["SSEKMSKeyId"] = kms_key_id
    return args


def _human(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def print_plan(plan: Plan, *, dry_run: bool, delete: bool, out) -> None:
    would = "would " if dry_run else ""
    uri = format_s3_uri(plan.bucket, plan.prefix)
    print(f"{uri}: {len(plan.upload)} to send ({_human(plan.bytes_to_send)}), {len(plan.skip)} unchanged, "
          f"{len(plan.delete)} not in the model directory, {len(plan.abort)} incomplete multipart uploads",
          file=out)
    for local, reason in plan.upload:
        print(f"  {would}send    {local.rel} ({_human(local.size)}; {reason})", file=out)
    if dry_run:
        for local in plan.skip:
            print(f"  {would}skip    {local.rel} (unchanged)", file=out)
    for key in plan.delete:
        action = f"{would}delete  " if delete else "keep    "
        note = "" if delete else " (not in the model directory; SageMaker downloads it too; --delete removes it)"
        print(f"  {action}s3://{plan.bucket}/{key}{note}", file=out)
    for key, _ in plan.abort:
        print(f"  {would}abort   incomplete multipart upload of s3://{plan.bucket}/{key}", file=out)


def abort_uploads(s3, bucket: str, uploads) -> List[str]:
    for key, upload_id in uploads:
        s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    return [key for key, _ in uploads]


def delete_keys(s3, bucket: str, keys: List[str]) -> List[str]:
    for start in range(0, len(keys), 1000):
        batch = keys[start:start + 1000]
        response = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True})
        errors = response.get("Errors", [])
        if errors:
            raise SyncError("could not delete: " + ", ".join(f"{e['Key']} ({e.get('Code')})" for e in errors))
    return list(keys)


class _Progress:
    """One tqdm bar over all bytes; s3transfer calls back from its worker threads."""

    def __init__(self, total: int, enabled: bool, desc: str):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                        disable=not enabled, file=sys.stderr)
        self.lock = threading.Lock()

    def __call__(self, amount: int) -> None:
        with self.lock:
            self.bar.update(amount)

    def close(self) -> None:
        self.bar.close()


def _run_transfers(s3, config, jobs, total: int, progress: bool, desc: str) -> List[str]:
    """Run ``jobs`` (callables taking (manager, subscribers) -> future); return the names that failed.

    Every transfer is awaited, so one failure does not stop the others (what arrives is
    kept for the next run); Ctrl-C cancels the rest, and the manager aborts the multipart
    uploads it had started.
    """
    from boto3.s3.transfer import ProgressCallbackInvoker, create_transfer_manager

    if not jobs:
        return []
    bar = _Progress(total, progress, desc)
    failed = []
    try:
        with create_transfer_manager(s3, config) as manager:
            subscribers = [ProgressCallbackInvoker(bar)]
            futures = [(name, submit(manager, subscribers)) for name, submit in jobs]
            for name, future in futures:
                try:
                    future.result()
                except Exception as exc:  # noqa: BLE001 - reported per file below
                    failed.append(f"{name}: {exc}")
    finally:
        bar.close()
    return failed


def upload_files(s3, plan: Plan, *, sse, kms_key_id, config, hasher: Hasher, progress: bool) -> List[str]:
    files = [local for local, _ in plan.upload]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, config.max_concurrency)) as pool:
        # hashed with the layout the upload will have, so verification reads each file once
        hashes = list(pool.map(lambda f: hasher.get(f.path, upload_part_size(f.size, config)), files))
    jobs = []
    for local, digest in zip(files, hashes):
        args = extra_args(sse, kms_key_id, digest.sha256_hex)

        def submit(manager, subscribers, local=local, args=args):
            return manager.upload(str(local.path), plan.bucket, plan.key(local.rel), extra_args=args,
                                  subscribers=subscribers)

        jobs.append((local.rel, submit))
    failed = _run_transfers(s3, config, jobs, plan.bytes_to_send, progress, "upload")
    if failed:
        raise SyncError(f"{len(failed)} of {len(jobs)} files were not uploaded (run again to send only "
                        "what is missing):\n  " + "\n  ".join(failed))
    return [local.rel for local, _ in plan.upload]


def sync(local_dir, s3_uri: str, s3, *, dry_run: bool = False, delete: bool = False, sse: Optional[str] = None,
         kms_key_id: Optional[str] = None, transfer_config=None, progress: bool = True, out=None) -> Report:
    """Make the prefix hold exactly the model directory's files, then verify every object.

    Raises ValueError for bad arguments and SyncError when files could not be sent;
    verification failures are in ``Report.problems`` (one line per key).
    """
    out = out or sys.stdout
    check_sse(sse, kms_key_id)
    bucket, prefix = parse_s3_uri(s3_uri)
    config = transfer_config or make_transfer_config()
    hasher = Hasher()
    plan = plan_sync(local_dir, bucket, prefix, s3, sse=sse, hasher=hasher, workers=config.max_concurrency)
    print_plan(plan, dry_run=dry_run, delete=delete, out=out)
    report = Report(format_s3_uri(bucket, prefix), dry_run, skipped=[f.rel for f in plan.skip])
    if dry_run:
        report.uploaded = [f.rel for f, _ in plan.upload]
        report.deleted = list(plan.delete) if delete else []
        report.stale = [] if delete else list(plan.delete)
        report.aborted = [k for k, _ in plan.abort]
        return report
    report.aborted = abort_uploads(s3, bucket, plan.abort)
    report.uploaded = upload_files(s3, plan, sse=sse, kms_key_id=kms_key_id, config=config, hasher=hasher,
                                   progress=progress)
    report.bytes_sent = plan.bytes_to_send
    if delete:
        report.deleted = delete_keys(s3, bucket, plan.delete)
    else:
        report.stale = list(plan.delete)
    report.problems = verify(local_dir, bucket, prefix, s3, hasher=hasher, workers=config.max_concurrency)
    return report


# ---------------------------------------------------------------------------- verify and download


def _verify_files(files: List[LocalFile], bucket: str, prefix: str, s3, hasher: Hasher, workers: int,
                  require_checksum: bool = True) -> List[str]:
    def check(local: LocalFile) -> Optional[str]:
        key = prefix + local.rel
        problem = compare(local, describe_remote(s3, bucket, key), hasher, require_checksum)
        return f"s3://{bucket}/{key}: {problem}" if problem else None

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return sorted(p for p in pool.map(check, files) if p)


def verify(local_dir, bucket: str, prefix: str, s3, *, hasher: Optional[Hasher] = None,
           workers: int = HEAD_WORKERS) -> List[str]:
    """Check the object of every file in ``local_dir`` against the file: one problem line per bad key."""
    return _verify_files(local_files(Path(local_dir)), bucket, _as_prefix(prefix), s3, hasher or Hasher(), workers)


def _safe_rel(key: str, prefix: str) -> str:
    rel = key[len(prefix):]
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise SyncError(f"refusing to download {key!r}: its name does not map to a path inside the directory")
    return rel


def download(uri: str, local_dir, s3, *, transfer_config=None, progress: bool = False) -> List[Path]:
    """Download every object under ``uri`` into ``local_dir`` (relative paths kept), as SageMaker does.

    The downloaded files are then verified against their objects' SHA-256 checksums (objects
    stored without one, by other tools, against their sizes); a mismatch raises SyncError
    naming the keys.
    """
    bucket, prefix = parse_s3_uri(uri)
    root = Path(local_dir)
    config = transfer_config or make_transfer_config()
    keys = {k: size for k, size in list_remote(s3, bucket, prefix).items() if not k.endswith("/")}
    targets = {key: root / _safe_rel(key, prefix) for key in sorted(keys)}
    jobs = []
    for key, target in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)

        def submit(manager, subscribers, key=key, target=target):
            return manager.download(bucket, key, str(target), subscribers=subscribers)

        jobs.append((key, submit))
    failed = _run_transfers(s3, config, jobs, sum(keys.values()), progress, "download")
    if failed:
        raise SyncError("download failed:\n  " + "\n  ".join(failed))
    files = [LocalFile(t.relative_to(root).as_posix(), t, t.stat().st_size) for t in targets.values()]
    problems = _verify_files(files, bucket, prefix, s3, Hasher(), config.max_concurrency, require_checksum=False)
    if problems:
        raise SyncError("downloaded files do not match their objects:\n  " + "\n  ".join(problems))
    return list(targets.values())


# ---------------------------------------------------------------------------- CLI


def make_client(endpoint_url: Optional[str] = None, region: Optional[str] = None, concurrency: int = 8):
    """An S3 client from boto3's standard credential chain, with a connection per transfer thread."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(region_name=region)
    return session.client("s3", endpoint_url=endpoint_url,
                          config=Config(max_pool_connections=max(10, concurrency + HEAD_WORKERS)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path, help="the built model directory (torch-model-archiver no-archive)")
    parser.add_argument("s3_uri", help="s3://bucket/prefix/ to upload under")
    parser.add_argument("--endpoint-url", help="an S3-compatible endpoint instead of AWS (tests, MinIO)")
    parser.add_argument("--region", help="AWS region (default: boto3's configuration)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be sent, skipped and deleted")
    parser.add_argument("--delete", action="store_true", help="remove objects under the prefix that are not local")
    parser.add_argument("--sse", choices=SSE_CHOICES, help="server-side encryption of the uploaded objects")
    parser.add_argument("--sse-kms-key-id", help="KMS key (id, ARN or alias) for --sse aws:kms")
    parser.add_argument("--concurrency", type=int, default=8, help="parallel transfers (default 8)")
    parser.add_argument("--multipart-threshold-mb", type=int, default=64,
                        help="files from this size (MiB) go in parts of this size (default 64; min 5)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be >= 1")
    if args.multipart_threshold_mb < 5:
        parser.error("--multipart-threshold-mb must be >= 5 (S3's smallest part is 5 MiB)")
    try:
        check_sse(args.sse, args.sse_kms_key_id)
        parse_s3_uri(args.s3_uri)
    except ValueError as exc:
        parser.error(str(exc))
    if not args.model_dir.is_dir():
        parser.error(f"{args.model_dir} is not a directory")

    from botocore.exceptions import BotoCoreError, ClientError

    config = make_transfer_config(args.concurrency, args.multipart_threshold_mb)
    try:
        s3 = make_client(args.endpoint_url, args.region, args.concurrency)
        report = sync(args.model_dir, args.s3_uri, s3, dry_run=args.dry_run, delete=args.delete, sse=args.sse,
                      kms_key_id=args.sse_kms_key_id, transfer_config=config, progress=not args.no_progress)
    except SyncError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; run the same command again to send only what is missing", file=sys.stderr)
        return 130
    except (BotoCoreError, ClientError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if report.dry_run:
        print("dry run: nothing was sent, deleted or aborted")
        return 0
    print(f"sent {len(report.uploaded)} files ({_human(report.bytes_sent)}), skipped {len(report.skipped)}, "
          f"deleted {len(report.deleted)}, aborted {len(report.aborted)} incomplete uploads")
    if report.problems:
        print(f"VERIFICATION FAILED for {len(report.problems)} objects:", file=sys.stderr)
        for problem in report.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    print(f"verified {len(report.uploaded) + len(report.skipped)} objects by SHA-256\n")
    print(model_data_block(report.uri))
    return 0


if __name__ == "__main__":
    sys.exit(main())
