"""Prefetch the weights in ggml's 16-bit dot products, for the llamacpp backend's llama-cpp-python build.

A decode step of one token multiplies each weight matrix by one vector: ggml computes one dot product per
weight row (``ggml_vec_dot_bf16`` for a bf16 GGUF, ``ggml_vec_dot_f16`` for an f16 one), loading the row
with no prefetch, so the memory's latency rather than its bandwidth bounds the step. On the AMX Xeon
(family 6 model 167, 2 vCPUs, the bench model's bf16 GGUF, llama-cpp-python 0.3.36's llama.cpp) a decode
step took 20.1 ms unpatched and 16.7 ms with the rows read 2 KB ahead (3 alternated runs each; a ggml
rebuilt unpatched with the same flags: 20.1). The project's own kernels prefetch the same way
(``llama_engine/backends/cpu_kernels.cpp``).

Only the backend's llama.cpp gets this; the bench's llama-server peer stays upstream's.

    python scripts/patch_ggml.py TREE    # TREE: a llama.cpp source tree (the sdist's vendor/llama.cpp)

Exit status 0: patched; 3: already patched; 2: the source no longer has the loops the patch expects (a
newer llama.cpp), nothing changed.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

MARK = "llama-torchserve: weight prefetch"
#: How far ahead of its reads a dot product fetches its weight row (the next rows follow in memory).
AHEAD_BYTES = 2048
VEC_SOURCE = Path("ggml/src/ggml-cpu/vec.cpp")
BRACE = re.compile(r"[{}]")

#: The loops over a weight row in each function, and the bytes one iteration reads of it.
LOOPS = {
    "ggml_vec_dot_bf16": (("for (; i + 64 <= n; i += 64) {", "64 * sizeof(ggml_bf16_t)"),
                          ("for (; i + 32 <= n; i += 32) {", "32 * sizeof(ggml_bf16_t)")),
    "ggml_vec_dot_f16": (("for (int i = 0; i < np; i += GGML_F16_DOT_STEP) {",
                          "GGML_F16_DOT_STEP * sizeof(ggml_fp16_t)"),),
}


class PatchError(RuntimeError):
    """The source does not have what the patch expects; the message says what is missing."""


def _prefetch(indent: str, step_bytes: str) -> str:
    return (f"{indent}    for (size_t pf = 0; pf < {step_bytes}; pf += 64)  // {MARK}\n"
            f"{indent}        __builtin_prefetch((const char *)(x + i) + {AHEAD_BYTES} + pf, 0, 3);\n")


def _function_body(source: str, name: str) -> tuple:
    """(start, end) of the body of the C function ``name``'s definition."""
    match = re.search(rf"^void {name}\(.*?\)\s*{{", source, flags=re.M | re.S)
    if not match:
        raise PatchError(f"no definition of {name} in {VEC_SOURCE}")
    depth, pos = 1, match.end()
    while depth:
        brace = BRACE.search(source, pos)
        if brace is None:
            raise PatchError(f"{name}'s body in {VEC_SOURCE} does not close")
        depth += 1 if brace.group() == "{" else -1
        pos = brace.end()
    return match.end(), pos


def add_weight_prefetch(source: str) -> str:
    """``source`` (vec.cpp) with a prefetch at the top of each weight-row loop of :data:`LOOPS`."""
    if MARK in source:
        return source
    for name, loops in LOOPS.items():
        start, end = _function_body(source, name)
        body = source[start:end]
        for loop, step_bytes in loops:
            pattern = re.compile(rf"^([ \t]*){re.escape(loop)}\n", flags=re.M)
            if not pattern.search(body):
                raise PatchError(f"{name} in {VEC_SOURCE} has no loop `{loop}`")
            body = pattern.sub(lambda m, step=step_bytes: m.group(0) + _prefetch(m.group(1), step), body)
        source = source[:start] + body + source[end:]
    return source


def patch_tree(tree: Path) -> bool:
    """Patch ``tree``'s vec.cpp in place; False where it was patched already."""
    path = Path(tree) / VEC_SOURCE
    if not path.is_file():
        raise PatchError(f"{path} not found: not a llama.cpp tree")
    source = path.read_text()
    patched = add_weight_prefetch(source)
    if patched == source:
        return False
    path.write_text(patched)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tree", type=Path, help="a llama.cpp source tree")
    args = parser.parse_args(argv)
    try:
        changed = patch_tree(args.tree)
    except PatchError as exc:
        print(f"patch_ggml: {exc}; left unpatched", file=sys.stderr)
        return 2
    print(f"patch_ggml: {args.tree / VEC_SOURCE}: " + ("weight prefetch added" if changed else "already patched"))
    return 0 if changed else 3


if __name__ == "__main__":
    sys.exit(main())
