#!/usr/bin/env bash
# Regenerates the runtime dataset shipped in data/trials.jsonl.gz, resumably (`make dataset`).
#
# 1. Profiles each model once: the 4 zoo models and the generator's catalogue
#    (hybridsync.zoo.GENERATED_MODELS, gen-<family>-<k>), into data/descriptions/<model>.json
#    (kept, so the description ids in the dataset stay the same across runs). Profile on a quiet
#    machine: a loaded one reads compute slow. To re-profile a model, write its file again with
#    the `hybridsync profile` command below, then point the stored trials at the new description
#    (its id hashes the timing) before the sweeps or the export:
#      hybridsync dataset redescribe --descriptions data/descriptions --models MODEL --store STORE
#    Jobs measured on a loaded machine are measured again, each lineup in one new job, and replace
#    the old trials (what the shipped dataset's 2026-11-25 16:00-21:30 jobs went through):
#      hybridsync dataset remeasure --from T0 --to T1 --descriptions data/descriptions --workdir DIR --store STORE
# 2. Calibration: on the first cluster, the reference row, every baseline and the first
#    CALIBRATION random strategies of each zoo model with AutoSync's full protocol (10 warm-up +
#    40 timed steps); benchmarks/trial_protocol.py compares shorter protocols against it.
# 3. The sweeps, cluster by cluster, with the short protocol (3 warm-up + 10 timed steps): every
#    generated model with SAMPLE random strategies, then every zoo model with ZOO_SAMPLE. Every
#    (model, cluster) job also measures the fair rivals (plain Horovod, Horovod with fp16 where it
#    runs, every baseline and its fp16 twin), the controls of that job. Trials already in the store are skipped. The slowest cluster comes last, so that
#    an interrupted run already covers the others. A trial may take 300 s: the `hierarchical`
#    baseline all-reduces the sparse tables of recommenders densely, ~2 s a step at 1 Gbit/s.
# 4. Exports the store to data/trials.jsonl.gz.
# The store (data/trials.db, not in git) keeps every finished trial: rerun to resume. To extend
# the shipped dataset rather than measure it all again, import it into the store first:
#   hybridsync dataset import data/trials.jsonl.gz --store sqlite:///data/trials.db
# Needs root (emulated clusters). STORE, SAMPLE, ZOO_SAMPLE, CALIBRATION and STEPS (timed steps of
# the sweeps, default 10; the shipped dataset's last jobs used 7 to finish on a loaded machine,
# benchmarks/RESULTS.md) may be overridden.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
hs=.venv/bin/hybridsync
store=${STORE:-sqlite:///data/trials.db}
sample=${SAMPLE:-12}
zoo_sample=${ZOO_SAMPLE:-40}
calibration=${CALIBRATION:-12}
steps=${STEPS:-10}
zoo_models=(ncf bert vgg resnet)
read -r -a generated <<< "$("$py" -c "from hybridsync.zoo import GENERATED_MODELS; print(*GENERATED_MODELS)")"
clusters=(horovodrun_configs/cluster_2x2_1gbit.yaml horovodrun_configs/cluster_2x2_500mbit_2ps.yaml
          horovodrun_configs/cluster_4x1_500mbit.yaml horovodrun_configs/cluster_2x2_250mbit.yaml)
mkdir -p data/descriptions
for model in "${zoo_models[@]}" "${generated[@]}"; do
  out=data/descriptions/$model.json
  if [ ! -f "$out" ]; then
    batch=$("$py" -c "from hybridsync.zoo import get; print(get('$model').batch_size)")
    "$hs" profile --name "$model" --batch-size "$batch" -o "$out" -- "$py" -m hybridsync.zoo.train --model "$model"
  fi
done
"$hs" trials sweep --models "${zoo_models[@]}" --clusters "${clusters[0]}" --sample "$calibration" \
  --warmup 10 --steps 40 --store "$store" --descriptions data/descriptions
sweep=("$hs" trials sweep --warmup 3 --steps "$steps" --trial-timeout 300 --store "$store" --descriptions data/descriptions)
for cluster in "${clusters[@]}"; do
  "${sweep[@]}" --clusters "$cluster" --models "${generated[@]}" --sample "$sample"
  "${sweep[@]}" --clusters "$cluster" --models "${zoo_models[@]}" --sample "$zoo_sample"
done
"$hs" dataset export --store "$store" -o data/trials.jsonl.gz
"$hs" dataset stats --store "$store"
