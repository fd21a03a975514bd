#!/usr/bin/env bash
# Regenerates every published figure that a simulator run produces (make results; not part of make
# test). Tens of minutes on two cores; JOBS sets the decision-quality benchmark's processes.
#   docs/decision-quality.md       python benchmarks/decision_quality.py --requests 120 --seed 0
#   docs/example-report/           controllerctl sim compare --scenario drift --requests 300 ... (report.md, PNGs)
#   docs/example-report/autoscale* controllerctl sim autoscale --out docs/example-report
#   README.md result blocks        python benchmarks/readme_results.py (from the two above)
# Each file names the command that wrote it. PYTHONHASHSEED is fixed: the runs are deterministic.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
JOBS=${JOBS:-2}
export PYTHONHASHSEED=0
echo "results: 1/4 decision quality (the longest step)" >&2
"$BIN/python" benchmarks/decision_quality.py --requests 120 --seed 0 --jobs "$JOBS" --out docs/decision-quality.md >/dev/null
echo "results: 2/4 docs/example-report (sim compare)" >&2
"$BIN/controllerctl" sim compare --scenario drift --requests 300 --concurrency 1,8,32 --out docs/example-report
echo "results: 3/4 docs/example-report/autoscale (sim autoscale)" >&2
"$BIN/controllerctl" sim autoscale --out docs/example-report
echo "results: 4/4 README.md result blocks" >&2
"$BIN/python" benchmarks/readme_results.py
