#!/usr/bin/env bash
# Installs everything hybridsync needs into .venv/ at the repo root, idempotently.
# A second run only checks: Horovod (a ~8 minute build) is rebuilt only when
# `horovod.torch` and `horovod.tensorflow` do not both import with Gloo and MPI built.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
cd "$repo"
venv="$repo/.venv"
py="$venv/bin/python"
log() { printf '[bootstrap] %s\n' "$*"; }

need_apt=()
command -v mpirun >/dev/null 2>&1 || need_apt+=(openmpi-bin)
[ -e /usr/lib/x86_64-linux-gnu/openmpi/include/mpi.h ] || [ -e /usr/include/x86_64-linux-gnu/mpi/mpi.h ] \
  || dpkg -s libopenmpi-dev >/dev/null 2>&1 || need_apt+=(libopenmpi-dev)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
command -v tc >/dev/null 2>&1 || need_apt+=(iproute2)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing Debian packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ ! -x "$py" ]; then
  log "creating $venv"
  python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
fi
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }

if ! "$py" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  log "installing torch==2.13.0 (CPU)"
  pip install torch==2.13.0
fi
if ! "$py" -c 'import numpy, yaml, mpi4py, xgboost, pytest, psutil, cloudpickle, tqdm, matplotlib, optuna, nevergrad, sklearn, tensorflow, mkdocs, material, mkdocstrings, mkdocstrings_handlers.python' 2>/dev/null; then
  log "installing pinned Python requirements"
  pip install -r "$repo/requirements.txt"
fi
# tf_keras (Keras 2 for TF_USE_LEGACY_KERAS=1) requires the `tensorflow` distribution, which
# tensorflow-cpu provides under another name: --no-deps keeps pip from fetching the full one.
if ! "$py" -c 'import tf_keras' 2>/dev/null; then
  log "installing tf_keras (Keras 2)"
  pip install --no-deps -r "$repo/requirements-tf-keras.txt"
fi

horovod_ok() {
  TF_CPP_MIN_LOG_LEVEL=3 "$py" - <<'PY' 2>/dev/null
import sys
import horovod.torch as hvd_torch
import horovod.tensorflow as hvd_tf
sys.exit(0 if all(h.gloo_built() and h.mpi_built() for h in (hvd_torch, hvd_tf)) else 1)
PY
}
if ! horovod_ok; then
  log "building horovod==0.28.1 with PyTorch, TensorFlow, Gloo and MPI (takes ~8 minutes on 2 cores)"
  pip install "setuptools<70" wheel
  # An installed Horovod built without TensorFlow would otherwise count as already satisfied.
  pip uninstall -y horovod 2>/dev/null || true
  # HYBRIDSYNC_TF_INCLUDE makes tools/cxx17 apply its TensorFlow fixes (see that file).
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
  HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO \
  HYBRIDSYNC_TF_INCLUDE="$(TF_CPP_MIN_LOG_LEVEL=3 "$py" -c 'import tensorflow as tf; print(tf.sysconfig.get_include())' 2>/dev/null)" \
  MAKEFLAGS=-j2 CXX="$repo/tools/cxx17" \
    "$py" -m pip --disable-pip-version-check install --no-build-isolation --no-cache-dir horovod==0.28.1 \
    > "$venv/horovod-build.log" 2>&1 || { tail -n 60 "$venv/horovod-build.log"; log "horovod build failed (full log: $venv/horovod-build.log)"; exit 1; }
  horovod_ok || { log "horovod installed but Gloo or MPI is missing"; exit 1; }
fi

# Reinstall (editable, so only metadata and console scripts) whenever setup.py changed.
stamp="$venv/.hybridsync-setup.sha256"
if ! "$py" -c 'import hybridsync' 2>/dev/null || ! sha256sum --quiet -c "$stamp" >/dev/null 2>&1; then
  log "installing hybridsync (editable)"
  pip install --no-deps --no-build-isolation -e "$repo"
  sha256sum "$repo/setup.py" > "$stamp"
fi
log "ready: $venv"
