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

The HLO is replaced by an HLO-equivalent description (a dict built by the model).
Two hashes of it exist, as in the real SDK, and they differ:

* ``get_hash_module(hlo_module, flags)`` (real ``compiler.py``): the first 20 hex digits of
  a sha256 over ``str(hlo_module)`` (here ``hlo_text``), plus the flags with spaces removed
  when ``flags`` is not None.  The cache key is ``get_hash_module(hlo_module, None)``:
  the HLO part of ``MODULE_<hlo hash>+<flags hash>``, flags not included.
* ``base.hash_hlo(hlo_module)`` (real ``base.py``): sha256 over
  ``hlo_module.SerializeToString()`` (here ``serialize``): the file names of
  ``save(dir)`` / ``load(dir)``.

The flags hash (libneuronxla's cache) is the first 8 hex digits of the md5 of
``json.dumps(<list of flag tokens>)``; checked against a real cache entry of SDK 2.20,
``MODULE_5ac5ea8b15390a9a05af+39f12043`` for the default flags.  Leaving the
cache-control options (``--cache_dir``, ``--retry_failed_compilation``) out of that list
is the double's assumption: libneuronxla's source is not public.
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


def hlo_text(hlo_module: dict) -> str:
    """The double's ``str(hlo_module)`` (the protobuf text format in the real SDK)."""
    return json.dumps(hlo_module, sort_keys=True, indent=1)


def serialize(hlo_module: dict) -> bytes:
    """The double's ``hlo_module.SerializeToString()``; also what ``model.hlo_module.pb`` holds."""
    return json.dumps(hlo_module, sort_keys=True, separators=(',', ':')).encode('utf-8')


def get_hash_module(hlo_module, flags):
    """As the real ``get_hash_module``: sha256 of ``str(hlo_module)`` (+ flags without spaces)."""
    hash_gen = hashlib.sha256()
    text = hlo_text(hlo_module)
    if flags is not None:
        text += flags.replace(" ", "")
    hash_gen.update(text.encode('utf-8'))
    return str(hash_gen.hexdigest())[:20]


def hash_flags(flags: list) -> str:
    """The persistent cache's flags hash: md5 of ``json.dumps`` of the flag tokens."""
    return hashlib.md5(json.dumps(flags).encode('utf-8')).hexdigest()[:8]


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
    hlo_hash, flags_hash = get_hash_module(description, None), hash_flags(flags)
    module_dir = os.path.join(cache_root(), f"neuronxcc-{version}", f"MODULE_{hlo_hash}+{flags_hash}")
    if os.path.isfile(os.path.join(module_dir, 'model.done')):
        with open(os.path.join(module_dir, 'model.neff'), 'rb') as f:
            neff = f.read()
        compiler_stats["hits"] += 1
        return hlo_hash, neff, module_dir, True
    os.makedirs(module_dir, exist_ok=True)
    neff = fake_neff(hlo_hash, flags_hash, version)
    _write(os.path.join(module_dir, 'model.hlo_module.pb'), serialize(description))
    _write(os.path.join(module_dir, 'compile_flags.json'), json.dumps(flags).encode())
    _write(os.path.join(module_dir, 'model.neff'), neff)
    _write(os.path.join(module_dir, 'model.done'), b'')
    compiler_stats["misses"] += 1
    return hlo_hash, neff, module_dir, False
