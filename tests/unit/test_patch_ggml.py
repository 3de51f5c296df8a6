"""scripts/patch_ggml.py: the weight prefetch in ggml's 16-bit dot products (the llamacpp backend's build).

* Each weight-row loop of ``ggml_vec_dot_bf16`` and ``ggml_vec_dot_f16`` gets a prefetch, and no loop of
  another function does; patching twice changes nothing; a source without the loops is left alone
  with a message that names what is missing.
* The patched source compiles and computes the dot products the unpatched one does.
* The sdist's own llama.cpp tree patches, and the llamacpp backend installed by ``make llamacpp``
  is built from patched source: its ``libggml-cpu.so`` prefetches in those functions.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from scripts import patch_ggml

ROOT = Path(__file__).resolve().parents[2]
#: The shapes of the loops in llama-cpp-python 0.3.36's vec.cpp, around functions that must stay untouched.
FIXTURE = r"""
#include <cstddef>
#include <cstdint>
#include <cstring>
typedef uint16_t ggml_bf16_t;
typedef uint16_t ggml_fp16_t;
#define GGML_F16_DOT_STEP 32
static float widen(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

void ggml_vec_dot_f32(int n, float * s, const float * x, const float * y) {
    float sum = 0;
    const int np = n & ~(GGML_F16_DOT_STEP - 1);
    for (int i = 0; i < np; i += GGML_F16_DOT_STEP) {
        for (int j = 0; j < GGML_F16_DOT_STEP; j++) sum += x[i + j] * y[i + j];
    }
    for (int i = np; i < n; i++) sum += x[i] * y[i];
    *s = sum;
}

void ggml_vec_dot_bf16(int n, float * s, size_t bs, ggml_bf16_t * x, size_t bx, ggml_bf16_t * y, size_t by, int nrc) {
    int i = 0;
    double sumf = 0;
#if defined(WIDE)
    for (; i + 64 <= n; i += 64) {
        for (int j = 0; j < 64; j++) sumf += widen(x[i + j]) * widen(y[i + j]);
    }
#endif
#if defined(HALVES)
    for (; i + 32 <= n; i += 32) {
        for (int j = 0; j < 16; j++) sumf += widen(x[i + j]) * widen(y[i + j]);
        for (int j = 16; j < 32; j++) sumf += widen(x[i + j]) * widen(y[i + j]);
    }
#else
    for (; i + 32 <= n; i += 32) {
        for (int j = 0; j < 32; j++) sumf += widen(x[i + j]) * widen(y[i + j]);
    }
#endif
    for (; i < n; i++) sumf += widen(x[i]) * widen(y[i]);
    *s = sumf;
}

void ggml_vec_dot_f16(int n, float * s, size_t bs, ggml_fp16_t * x, size_t bx, ggml_fp16_t * y, size_t by, int nrc) {
    double sumf = 0.0;
    const int np = (n & ~(GGML_F16_DOT_STEP - 1));
    {
        for (int i = 0; i < np; i += GGML_F16_DOT_STEP) {
            for (int j = 0; j < GGML_F16_DOT_STEP; j++) sumf += widen(x[i + j]) * widen(y[i + j]);
        }
        for (int i = np; i < n; ++i) sumf += widen(x[i]) * widen(y[i]);
    }
    *s = sumf;
}

void ggml_vec_silu_f32(const int n, float * y, const float * x) {
    for (int i = 0; i < n; ++i) y[i] = x[i];
}
"""

HARNESS = r"""
#include <cstdio>
void ggml_vec_dot_bf16(int, float *, size_t, ggml_bf16_t *, size_t, ggml_bf16_t *, size_t, int);
void ggml_vec_dot_f16(int, float *, size_t, ggml_fp16_t *, size_t, ggml_fp16_t *, size_t, int);
int main() {
    static uint16_t x[4099], y[4099];
    for (int i = 0; i < 4099; i++) { x[i] = (uint16_t)(0x3f80 + (i * 37) % 200); y[i] = (uint16_t)(0xbf00 + (i * 11) % 300); }
    const int lengths[] = {1, 31, 64, 100, 768, 4099};
    for (int n : lengths) {
        float a, b;
        ggml_vec_dot_bf16(n, &a, 0, x, 0, y, 0, 1);
        ggml_vec_dot_f16(n, &b, 0, x, 0, y, 0, 1);
        printf("%d %.9g %.9g\n", n, a, b);
    }
}
"""


def test_every_weight_row_loop_of_the_two_dot_products_prefetches_and_no_other_loop_does():
    patched = patch_ggml.add_weight_prefetch(FIXTURE)
    assert patched.count(patch_ggml.MARK) == 4  # bf16: the 64 loop and both 32 loops; f16: its loop
    for name in patch_ggml.LOOPS:
        start, end = patch_ggml._function_body(patched, name)
        body = patched[start:end]
        for line in re.finditer(r"^\s*for \((?:;|int i = 0;).*\{\n(.*)\n", body, re.M):
            assert patch_ggml.MARK in line.group(1), f"{name}: no prefetch after `{line.group(0).strip()}`"
    for untouched in ("ggml_vec_dot_f32", "ggml_vec_silu_f32"):
        body, original = (text[slice(*patch_ggml._function_body(text, untouched))] for text in (patched, FIXTURE))
        assert body == original and patch_ggml.MARK not in body
    assert "__builtin_prefetch((const char *)(x + i) + 2048 + pf, 0, 3);" in patched


def test_patching_twice_changes_nothing_and_the_tree_reports_it(tmp_path):
    vec = tmp_path / patch_ggml.VEC_SOURCE
    vec.parent.mkdir(parents=True)
    vec.write_text(FIXTURE)
    assert patch_ggml.main([str(tmp_path)]) == 0
    once = vec.read_text()
    assert patch_ggml.add_weight_prefetch(once) == once
    assert patch_ggml.main([str(tmp_path)]) == 3
    assert vec.read_text() == once


def test_a_source_without_the_loops_is_left_alone_with_what_is_missing(tmp_path, capsys):
    changed = FIXTURE.replace("for (; i + 32 <= n; i += 32) {", "for (; i + 16 <= n; i += 16) {")
    with pytest.raises(patch_ggml.PatchError, match=r"ggml_vec_dot_bf16 .* no loop `for \(; i \+ 32 <= n; i \+= 32\) \{`"):
        patch_ggml.add_weight_prefetch(changed)
    with pytest.raises(patch_ggml.PatchError, match="no definition of ggml_vec_dot_f16"):
        patch_ggml.add_weight_prefetch(FIXTURE.replace("void ggml_vec_dot_f16(", "void ggml_vec_dot_fp16("))
    vec = tmp_path / patch_ggml.VEC_SOURCE
    vec.parent.mkdir(parents=True)
    vec.write_text(changed)
    assert patch_ggml.main([str(tmp_path)]) == 2
    assert vec.read_text() == changed
    assert "no loop" in capsys.readouterr().err
    assert patch_ggml.main([str(tmp_path / "nowhere")]) == 2
    assert "not a llama.cpp tree" in capsys.readouterr().err


@pytest.mark.parametrize("defines", [[], ["-DWIDE"], ["-DHALVES"], ["-DWIDE", "-DHALVES"]])
def test_the_patched_source_compiles_and_computes_what_the_unpatched_one_does(tmp_path, defines):
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "the native kernels' tests need a C++ compiler as well"
    outputs = []
    for name, source in (("plain", FIXTURE), ("patched", patch_ggml.add_weight_prefetch(FIXTURE))):
        src = tmp_path / f"{name}.cpp"
        src.write_text(source + HARNESS)
        exe = tmp_path / name
        subprocess.run([cxx, "-O2", "-std=c++17", *defines, str(src), "-o", str(exe)],
                       check=True, capture_output=True, text=True)
        outputs.append(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 6


def _backend_tree() -> Path:
    tree = ROOT / "build" / "peers" / "llama-cpp-python-src" / "vendor" / "llama.cpp"
    assert (tree / patch_ggml.VEC_SOURCE).is_file(), f"{tree}: run `make llamacpp` (the tests' setup builds it)"
    return tree


def test_the_sdists_llama_cpp_is_patched_where_the_backend_was_built_from():
    source = (_backend_tree() / patch_ggml.VEC_SOURCE).read_text()
    assert source.count(patch_ggml.MARK) == 4
    assert patch_ggml.add_weight_prefetch(source) == source


def test_the_installed_backends_ggml_prefetches_in_its_16_bit_dot_products():
    import llama_cpp  # make test builds it first (make llamacpp)

    objdump = shutil.which("objdump")
    assert objdump, "objdump (binutils) is needed; the C++ compiler's toolchain has it"
    library = next((Path(llama_cpp.__file__).parent / "lib").glob("libggml-cpu.so*"))
    for function in ("ggml_vec_dot_bf16", "ggml_vec_dot_f16"):
        listing = subprocess.run([objdump, "-d", f"--disassemble={function}", str(library)],
                                 check=True, capture_output=True, text=True).stdout
        assert re.search(rf"<{function}(@@\w+)?>:", listing), f"{library} has no {function}"
        assert "prefetcht0" in listing, f"{library}'s {function} does not prefetch: built from unpatched source"
