#!/usr/bin/env bash
# Paper-style runs: SSGD, SSD-SGD and SSD-SGD + top-k 1%, then the comparison table and plots.
#
#   scripts/reproduce.sh cifar10|imagenet DATA_ROOT [HOSTFILE INTERFACE]
#   (scripts/reproduce_cifar10.sh and scripts/reproduce_imagenet.sh call this)
#
# cifar10: ResNet-20; DATA_ROOT holds the CIFAR-10 binary (data_batch_1.bin ... test_batch.bin) or python
# batches. imagenet: ResNet-50; DATA_ROOT holds im2rec output (train.rec/.idx, val.rec/.idx).
# With HOSTFILE and INTERFACE the jobs run across hosts with the ssh launcher (the run folders must be
# on a file system all hosts share); otherwise locally. OUT (default results/<dataset>) receives the runs,
# a comparison table and the plots. Extra --set overrides can be passed in SETS, e.g.
#   SETS="--set cluster.workers=4" scripts/reproduce_cifar10.sh /data/cifar10
# A second run into the same OUT finds the first one's checkpoints and is refused; RUN_ARGS=--resume
# continues those runs, RUN_ARGS=--overwrite deletes their checkpoints and starts afresh.
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: $0 cifar10|imagenet DATA_ROOT [HOSTFILE INTERFACE]"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
case $1 in
  cifar10) configs="cifar10_resnet20_ssgd cifar10_resnet20_ssd cifar10_resnet20_ssd_topk" ;;
  imagenet) configs="imagenet_resnet50_ssgd imagenet_resnet50_ssd imagenet_resnet50_ssd_topk" ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
out=${OUT:-results/$1}
shift
root=$(readlink -f "$1")
[ -d "$root" ] || { echo "error: data folder $1 does not exist" >&2; exit 2; }
py=${PYTHON:-.venv/bin/python}
cluster=()
if [ $# -ge 3 ]; then
  cluster=(--set cluster.launcher=ssh --set "cluster.hostfile=$(readlink -f "$2")" --set "cluster.interface=$3")
else
  cluster=(--set cluster.launcher=local --set cluster.hostfile=null --set cluster.interface=null)
fi
runs=()
for cfg in $configs; do
  echo "=== $cfg"
  # shellcheck disable=SC2086
  "$py" -m ssdsgd --config "configs/$cfg.yaml" --set "data.root=$root" --set "log.dir=$out/runs" \
    --set "checkpoint.dir=$out/checkpoints/$cfg" "${cluster[@]}" ${SETS:-} ${RUN_ARGS:-}
  runs+=("$out/runs/$cfg")
done
"$py" scripts/compare.py "${runs[@]}" | tee "$out/table.txt"
"$py" scripts/plot.py --runs "${runs[@]}" --out "$out"
