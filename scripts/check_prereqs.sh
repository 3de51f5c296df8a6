#!/usr/bin/env bash
# Check what `make` needs before it creates anything; say how to install what is missing.
set -u
PY=${1:-python3}
fail=0
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "missing: $PY (Python 3.10+). Install it, e.g. 'apt-get install python3 python3-venv', or run make PY=/path/to/python3" >&2
  fail=1
elif ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)'; then
  echo "too old: $("$PY" --version 2>&1); Python 3.10+ is needed. Install a newer Python and run make PY=/path/to/python3" >&2
  fail=1
elif ! "$PY" -c 'import venv, ensurepip' >/dev/null 2>&1; then
  echo "missing: the venv module for $PY. Install it, e.g. 'apt-get install python3-venv'" >&2
  fail=1
fi
if ! command -v java >/dev/null 2>&1; then
  echo "missing: java (a Java 17 runtime, for TorchServe's frontend). Install it, e.g. 'apt-get install openjdk-17-jre-headless'" >&2
  fail=1
else
  major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -n1)
  if [ -z "$major" ] || [ "$major" -lt 17 ]; then
    echo "too old: java ${major:-unknown}; TorchServe needs Java 17+. Install e.g. 'apt-get install openjdk-17-jre-headless'" >&2
    fail=1
  fi
fi
if ! command -v curl >/dev/null 2>&1; then
  echo "missing: curl. Install it, e.g. 'apt-get install curl'" >&2
  fail=1
fi
if [ -z "${CXX:-}" ] && ! command -v g++ >/dev/null 2>&1 && ! command -v c++ >/dev/null 2>&1; then
  # not fatal: the build step ships no native CPU kernels and the torch backend keeps torch's (slower decode)
  echo "note: no C++ compiler (g++ or \$CXX): the torch backend's native CPU kernels will not be built, and" \
       "it decodes on torch's kernels. Install one for them, e.g. 'apt-get install g++'" >&2
fi
exit $fail
