"""A compile cache that ships inside the model artifact, with a manifest that guards it.

The build step compiles the model with the compiler's cache pointed into the build
directory, then writes ``manifest.json`` next to the cache: the versions of everything that
shapes the compiled artifacts, the Python path, the compile settings and a sha256 of every
file. At load, the handler verifies the manifest against what is installed and configured
and refuses a mismatch (unless ``handler.allow_recompile``) instead of silently recompiling
for an hour. The model directory may be read-only (SageMaker's /opt/ml/model), and
compilers write lock and index files next to their entries, so the verified cache is
copied to a writable directory and the compiler is pointed there.

Two kinds share this path. For Neuron the shipped directory holds the compiled graphs that
transformers-neuronx's ``model.save()`` wrote (``neff/<hlo hash>.neff``); the handler loads
them with ``model.load()``, so a graph that does not match is a ``FileNotFoundError`` and
never a compile. ``NEURON_COMPILE_CACHE_URL`` still points at the writable copy, which is
where ``allow_recompile`` compiles. For ``compile: true`` on the torch backend it is
TorchInductor's cache (``TORCHINDUCTOR_CACHE_DIR``).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, Optional

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = 1
#: Where the build puts transformers-neuronx's ``model.save()`` output inside the shipped cache.
SAVED_NEFFS = "neff"


class CompileCacheError(RuntimeError):
    """The shipped compile cache cannot be used as it is; the message says how to rebuild."""


@dataclass(frozen=True)
class CacheKind:
    name: str
    env_var: str
    #: (distribution name, importable module) whose versions are baked into the artifacts
    packages: tuple

    def versions(self) -> Dict[str, Optional[str]]:
        return {dist: package_version(dist, module) for dist, module in self.packages}


NEURON = CacheKind("neuron", "NEURON_COMPILE_CACHE_URL", (
    ("neuronx-cc", "neuronxcc"), ("torch-neuronx", "torch_neuronx"),
    ("transformers-neuronx", "transformers_neuronx"), ("transformers", "transformers"), ("torch", "torch"),
))
INDUCTOR = CacheKind("inductor", "TORCHINDUCTOR_CACHE_DIR", (
    ("torch", "torch"), ("transformers", "transformers"),
))
KINDS = {k.name: k for k in (NEURON, INDUCTOR)}


def package_version(dist: str, module: str) -> Optional[str]:
    """The installed version; the module's ``__version__`` first (test doubles have no dist-info)."""
    try:
        mod = importlib.import_module(module)
        version = getattr(mod, "__version__", None)
        if version:
            return str(version)
    except ImportError:
        pass
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_files(cache_dir: Path) -> Iterable[Path]:
    for path in sorted(cache_dir.rglob("*")):
        if path.is_file() and path.name != MANIFEST and not path.name.endswith(".lock"):
            yield path


def write_manifest(cache_dir: Path, kind: CacheKind, settings: dict) -> dict:
    cache_dir = Path(cache_dir)
    files = {str(p.relative_to(cache_dir)): sha256_file(p) for p in cache_files(cache_dir)}
    manifest = {
        "format": FORMAT,
        "kind": kind.name,
        "versions": kind.versions(),
        "python": {"executable": sys.executable, "prefix": sys.prefix,
                   "version": ".".join(map(str, sys.version_info[:3]))},
        "settings": settings,
        "files": files,
    }
    (cache_dir / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def read_manifest(cache_dir: Path) -> dict:
    path = Path(cache_dir) / MANIFEST
    if not path.exists():
        raise CompileCacheError(f"{cache_dir}: no {MANIFEST}; the model was packaged without a compile cache. "
                                "Rebuild it with `make build MODEL=<config>`")
    return json.loads(path.read_text())


def check_manifest(cache_dir: Path, manifest: dict, kind: CacheKind, settings: dict) -> list:
    """Every way the shipped cache differs from what is installed and configured."""
    problems = []
    if manifest.get("format") != FORMAT or manifest.get("kind") != kind.name:
        problems.append(f"manifest is for {manifest.get('kind')!r} format {manifest.get('format')}, "
                        f"expected {kind.name!r} format {FORMAT}")
    for dist, built in manifest.get("versions", {}).items():
        installed = kind.versions().get(dist)
        if installed != built:
            problems.append(f"{dist}: compiled with {built}, installed {installed or 'nothing (not installed)'}")
    for key in sorted(set(settings) | set(manifest.get("settings", {}))):
        built, now = manifest.get("settings", {}).get(key), settings.get(key)
        if built != now:
            problems.append(f"setting {key}: compiled with {built!r}, configured {now!r}")
    for rel, digest in manifest.get("files", {}).items():
        path = Path(cache_dir) / rel
        if not path.is_file():
            problems.append(f"missing cache file {rel}")
        elif sha256_file(path) != digest:
            problems.append(f"checksum mismatch in cache file {rel} (tampered or corrupted)")
    return problems


def writable_copy(cache_dir: Path, manifest: dict, root: Optional[Path] = None) -> Path:
    """Mirror the verified cache into a writable directory named by the manifest's digest.

    Directories are created for real (compilers add lock files and new entries there); files
    are symlinks to the shipped ones, so a multi-GB Neuron cache costs no copy.
    """
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(root or os.environ.get("LLAMA_COMPILE_CACHE_DIR") or Path(tempfile.gettempdir()) / "llama-compile-cache")
    target = root / f"{manifest['kind']}-{digest}"
    if not (target / MANIFEST).exists():
        staging = root / f".{target.name}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(Path(cache_dir).resolve(), staging, copy_function=_symlink)
        for path in [staging, *staging.rglob("*")]:
            if path.is_dir() and not path.is_symlink():
                os.chmod(path, 0o755)
        try:
            staging.rename(target)
        except OSError:  # another worker got there first
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _symlink(src: str, dst: str) -> None:
    os.symlink(os.path.abspath(src), dst)


@dataclass
class CacheSession:
    """The cache a process compiles against, and what it held when the process started."""

    kind: CacheKind
    path: Path
    shipped: int
    before: frozenset
    #: True when ``path`` mirrors a shipped cache whose manifest matched this host.
    verified: bool = False

    @classmethod
    def start(cls, kind: CacheKind, path: Path, verified: bool = False) -> "CacheSession":
        os.environ[kind.env_var] = str(path)
        entries = frozenset(_entries(path))
        return cls(kind, path, len(entries), entries, verified)

    def saved_neffs(self) -> Optional[Path]:
        """The verified ``model.save()`` directory to ``model.load()`` from, or None (compile instead)."""
        return self.path / SAVED_NEFFS if self.verified and self.kind is NEURON else None

    def new_entries(self) -> list:
        return sorted(set(_entries(self.path)) - self.before)

    def report(self) -> dict:
        """Log whether loading compiled anything; 0 new entries means every graph hit the cache."""
        new = self.new_entries()
        stats = {"kind": self.kind.name, "shipped_entries": self.shipped, "new_entries": len(new)}
        if self.kind is INDUCTOR:
            from torch._dynamo.utils import counters

            stats.update(fxgraph_cache_hit=counters["inductor"]["fxgraph_cache_hit"],
                         fxgraph_cache_miss=counters["inductor"]["fxgraph_cache_miss"])
        logger.info("compile cache: %s", json.dumps(stats, sort_keys=True))
        for entry in new[:20]:
            logger.info("compile cache miss: compiled %s at load", entry)
        return stats


def _entries(path: Path) -> list:
    """Cache entries: Neuron MODULE_* directories, or the files of any other cache (and the
    saved NEFFs of a shipped Neuron cache, which holds no MODULE_* directory)."""
    path = Path(path)
    if not path.exists():
        return []
    modules = [str(p.relative_to(path)) for p in path.glob("neuronxcc-*/MODULE_*")]
    if modules:
        return modules
    return [str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and not p.name.endswith(".lock")
            and p.name != MANIFEST]


def activate(model_dir: str, cache_name: str, kind: CacheKind, settings: dict,
             allow_recompile: bool) -> CacheSession:
    """Verify the shipped cache, copy it somewhere writable, and point the compiler at it."""
    shipped = Path(model_dir) / cache_name
    try:
        manifest = read_manifest(shipped)
        problems = check_manifest(shipped, manifest, kind, settings)
    except CompileCacheError:
        if not allow_recompile:
            raise
        manifest, problems = None, ["no shipped cache"]
    if problems and not allow_recompile:
        raise CompileCacheError(
            f"the compile cache in {shipped} does not match this host:\n  - " + "\n  - ".join(problems) +
            "\nRebuild the model on a host with these versions (`make build MODEL=<config>`), or set "
            "handler.allow_recompile: true to compile at load (slow: minutes to an hour on Neuron)")
    if manifest is not None and not problems:
        target = writable_copy(shipped, manifest)
        _warn_python_path(manifest)
    else:
        logger.warning("compile cache: %s; compiling at load because handler.allow_recompile is true",
                       "; ".join(problems))
        target = Path(tempfile.mkdtemp(prefix=f"llama-compile-{kind.name}-"))
    logger.info("compile cache (%s): %s -> %s", kind.name, shipped, target)
    return CacheSession.start(kind, target, verified=manifest is not None and not problems)


def _warn_python_path(manifest: dict) -> None:
    built = manifest.get("python", {}).get("executable")
    if built and os.path.realpath(built) != os.path.realpath(sys.executable):
        logger.warning("compile cache was built with Python %s, running %s; some Neuron SDK versions "
                       "hash the Python path into graphs, so expect cache misses if they appear", built,
                       sys.executable)
