#!/usr/bin/env bash
# Paper-style CIFAR-10 runs: SSGD, SSD-SGD and SSD-SGD + top-k 1% on ResNet-20, then the comparison plot.
#
#   scripts/reproduce_cifar10.sh DATA_ROOT [HOSTFILE INTERFACE]
#
# DATA_ROOT holds the CIFAR-10 binary (data_batch_1.bin ... test_batch.bin) or python batches.
# With HOSTFILE and INTERFACE the jobs run across hosts with the ssh launcher (the run folders must be
# on a file system all hosts share); otherwise locally. OUT (default results/cifar10) receives the runs,
# a comparison table and the plots. Extra --set overrides can be passed in SETS, e.g.
#   SETS="--set cluster.workers=4" scripts/reproduce_cifar10.sh /data/cifar10
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 DATA_ROOT [HOSTFILE INTERFACE]" >&2; exit 2; }
root=$(readlink -f "$1")
[ -d "$root" ] || { echo "error: data folder $1 does not exist" >&2; exit 2; }
py=${PYTHON:-.venv/bin/python}
out=${OUT:-results/cifar10}
cluster=()
if [ $# -ge 3 ]; then
  cluster=(--set cluster.launcher=ssh --set "cluster.hostfile=$(readlink -f "$2")" --set "cluster.interface=$3")
else
  cluster=(--set cluster.launcher=local --set cluster.hostfile=null)
fi
runs=()
for cfg in cifar10_resnet20_ssgd cifar10_resnet20_ssd cifar10_resnet20_ssd_topk; do
  echo "=== $cfg"
  # shellcheck disable=SC2086
  "$py" -m ssdsgd.run --config "configs/$cfg.yaml" --set "data.root=$root" --set "log.dir=$out/runs" \
    --set "checkpoint.dir=$out/checkpoints/$cfg" "${cluster[@]}" ${SETS:-}
  runs+=("$out/runs/$cfg")
done
"$py" scripts/compare.py "${runs[@]}" | tee "$out/table.txt"
"$py" scripts/plot.py --runs "${runs[@]}" --out "$out"
