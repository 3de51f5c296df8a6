"""Test double of ``transformers_neuronx/compiler.py`` (aws-neuron/transformers-neuronx),
folded together with the Neuron persistent compile cache that the real module reaches
through ``libneuronxla.neuron_cc_cache``.

What is reproduced:

* ``get_compiler_flags()``: ``NEURON_CC_FLAGS`` plus the real defaults
  (``--model-type=transformer``, ``--auto-cast=none``) when the user did not set them;
  ``compile_hlo_module`` then appends ``--execute-repetition=1``.
* Cache location: ``--cache_dir=`` in ``NEURON_CC_FLAGS`` wins over
  ``NEURON_COMPILE_CACHE_URL``; default ``/var/tmp/neuron-compile-cache``.  An ``s3://``
  URL is refused with ``ValueError`` (the double supports local paths only).
* Layout: ``<cache>/neuronxcc-<neuronxcc.__version__>/MODULE_<hlo hash>+<flags hash>/``
  holding ``model.hlo_module.pb``, ``compile_flags.json``, ``model.neff`` and
  ``model.done``.  ``model.done`` present means a hit; otherwise the graph is
  "compiled" (the files are written, ``model.done`` last).

The HLO is replaced by an HLO-equivalent description (a dict built by the model);
its hash is the first 20 hex digits of a sha256, like the real ``get_hash_module``.
The flags hash is the first 8 hex digits of an md5 of the flags with spaces removed.
Cache-control options (``--cache_dir``, ``--retry_failed_compilation``) are not part of it.
"""
import hashlib
import json
import os
import shlex

import neuronxcc

DEFAULT_CACHE_DIR = "/var/tmp/neuron-compile-cache"
_CACHE_OPTIONS = ("--cache_dir", "--retry_failed_compilation")

#: Process-wide lookup counters: cache ``hits``/``misses`` and graphs ``loaded`` from
#: ``model.load(dir)`` artifacts.  Also exported as ``transformers_neuronx.compiler_stats``.
compiler_stats = {"hits": 0, "misses": 0, "loaded": 0}


def reset_compiler_stats():
    """Zero ``compiler_stats`` in place (the dict object stays the same)."""
    for key in compiler_stats:
        compiler_stats[key] = 0


def get_compiler_flags() -> str:
    """User flags from ``NEURON_CC_FLAGS`` plus the real defaults for unset keys."""
    user_flags = os.environ.get('NEURON_CC_FLAGS', '').strip()
    flags = [user_flags] if user_flags else []
    for key, value in {'--model-type': 'transformer', '--auto-cast': 'none'}.items():
        if key not in user_flags:
            flags.append(f'{key}={value}')
    return ' '.join(flags)


def _user_cache_dir():
    """The ``--cache_dir=`` value in ``NEURON_CC_FLAGS``, if any."""
    tokens = shlex.split(os.environ.get('NEURON_CC_FLAGS', ''))
    for i, token in enumerate(tokens):
        if token.startswith('--cache_dir='):
            return token.split('=', 1)[1]
        if token == '--cache_dir' and i + 1 < len(tokens):
            return tokens[i + 1]
    return None


def compile_flags() -> list:
    """The compiler flags of one graph compile, without the cache-control options."""
    tokens = shlex.split(get_compiler_flags()) + ['--execute-repetition=1']
    kept, skip_next = [], False
    for token in tokens:
        if skip_next:
            skip_next = False
        elif token == '--cache_dir':
            skip_next = True
        elif not token.startswith(_CACHE_OPTIONS):
            kept.append(token)
    return kept


def cache_root() -> str:
    """The persistent cache directory in force now."""
    url = _user_cache_dir() or os.environ.get('NEURON_COMPILE_CACHE_URL') or DEFAULT_CACHE_DIR
    if url.startswith('s3://'):
        raise ValueError(
            f"Neuron compile cache URL {url!r}: the Neuron test double supports local cache "
            "directories only (the real SDK would use S3 here)")
    return url


def hash_description(description: dict) -> str:
    """HLO hash: 20 hex digits of sha256 over the canonical JSON description."""
    text = json.dumps(description, sort_keys=True, separators=(',', ':'))
    return hashlib.sha256(text.encode('utf-8')).hexdigest()[:20]


def hash_flags(flags: list) -> str:
    return hashlib.md5(' '.join(flags).replace(' ', '').encode('utf-8')).hexdigest()[:8]


def fake_neff(hlo_hash: str, flags_hash: str, compiler_version: str) -> bytes:
    """Deterministic stand-in for a NEFF: a readable header plus a digest."""
    header = json.dumps({"hlo_hash": hlo_hash, "flags_hash": flags_hash,
                         "compiler_version": compiler_version}, sort_keys=True)
    digest = hashlib.sha256(f"{hlo_hash}+{flags_hash}@{compiler_version}".encode()).digest()
    return b"NEFF-DOUBLE\n" + header.encode() + b"\n" + digest * 8


def _write(path, data: bytes):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, 'wb') as f:
        f.write(data)
    os.replace(tmp, path)


def compile_description(description: dict):
    """Look a graph up in the persistent cache, "compiling" it on a miss.

    Returns ``(hlo_hash, neff_bytes, module_dir, hit)``.  The caller accounts for
    compile time (``FAKE_NEURON_COMPILE_SECONDS``), since the real library compiles
    all of a model's graphs in parallel.
    """
    version = neuronxcc.__version__
    flags = compile_flags()
    hlo_hash, flags_hash = hash_description(description), hash_flags(flags)
    module_dir = os.path.join(cache_root(), f"neuronxcc-{version}", f"MODULE_{hlo_hash}+{flags_hash}")
    if os.path.isfile(os.path.join(module_dir, 'model.done')):
        with open(os.path.join(module_dir, 'model.neff'), 'rb') as f:
            neff = f.read()
        compiler_stats["hits"] += 1
        return hlo_hash, neff, module_dir, True
    os.makedirs(module_dir, exist_ok=True)
    neff = fake_neff(hlo_hash, flags_hash, version)
    text = json.dumps(description, sort_keys=True, indent=1)
    _write(os.path.join(module_dir, 'model.hlo_module.pb'), text.encode())
    _write(os.path.join(module_dir, 'compile_flags.json'), json.dumps(flags).encode())
    _write(os.path.join(module_dir, 'model.neff'), neff)
    _write(os.path.join(module_dir, 'model.done'), b'')
    compiler_stats["misses"] += 1
    return hlo_hash, neff, module_dir, False
