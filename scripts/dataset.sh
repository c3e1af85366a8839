#!/usr/bin/env bash
# Regenerates the runtime dataset shipped in data/trials.jsonl, resumably (`make dataset`).
#
# 1. Profiles each zoo model once (data/descriptions/<model>.json; kept, so the description
#    ids in the dataset stay the same across runs).
# 2. Calibration: on the first cluster, the reference row, every baseline and the first
#    CALIBRATION random strategies of each model with AutoSync's full protocol (10 warm-up +
#    40 timed steps); benchmarks/trial_protocol.py compares shorter protocols against it.
# 3. The sweep: every model x every cluster, SAMPLE random strategies each, with the short
#    protocol (3 warm-up + 10 timed steps; trials already in the store are skipped).
# 4. Exports the store to data/trials.jsonl.
# The store (data/trials.db, not in git) keeps every finished trial: rerun to resume.
# Needs root (emulated clusters). STORE, SAMPLE and CALIBRATION may be overridden.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
hs=.venv/bin/hybridsync
store=${STORE:-sqlite:///data/trials.db}
sample=${SAMPLE:-77}
calibration=${CALIBRATION:-12}
models=(ncf bert vgg resnet)
clusters=(horovodrun_configs/cluster_2x2_1gbit.yaml horovodrun_configs/cluster_2x2_250mbit.yaml
          horovodrun_configs/cluster_4x1_500mbit.yaml)
mkdir -p data/descriptions
for model in "${models[@]}"; do
  out=data/descriptions/$model.json
  if [ ! -f "$out" ]; then
    batch=$("$py" -c "from hybridsync.zoo import get; print(get('$model').batch_size)")
    "$hs" profile --name "$model" --batch-size "$batch" -o "$out" -- "$py" -m hybridsync.zoo.train --model "$model"
  fi
done
"$hs" trials sweep --models "${models[@]}" --clusters "${clusters[0]}" --sample "$calibration" \
  --warmup 10 --steps 40 --store "$store" --descriptions data/descriptions
"$hs" trials sweep --models "${models[@]}" --clusters "${clusters[@]}" --sample "$sample" \
  --warmup 3 --steps 10 --trial-timeout 120 --store "$store" --descriptions data/descriptions \
  --export data/trials.jsonl
"$hs" dataset stats --store "$store"
