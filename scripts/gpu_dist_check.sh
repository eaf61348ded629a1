#!/usr/bin/env bash
# Vocab-parallel and FSDP2 on a machine with two or more CUDA GPUs, from a checkout of this repository:
#   bash scripts/gpu_dist_check.sh [tests] [bench]
# tests: tests/test_distributed.py over NCCL (the CPU suite's cases, one GPU per rank; world size 3
#        needs three GPUs and is skipped otherwise); bench: benchmarks/bench_dist.py on two GPUs (the seed
#        JSD workload vocab-parallel against one GPU, and the FSDP2 routes' time and formula bytes).
# Logs and results go to $OUT (default ./gpu-dist-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-dist-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
  echo "gpu_dist_check.sh: needs at least 2 CUDA GPUs, found $gpus" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/env.txt"
stages=${*:-tests bench}
status=0
for stage in $stages; do
  echo "=== $stage"
  case $stage in
    tests) FLASHKD_DIST_BACKEND=nccl python3 -m pytest -q tests/test_distributed.py 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1 ;;
    bench) torchrun --standalone --nproc_per_node=2 benchmarks/bench_dist.py --out "$OUT/bench_dist.json" 2>&1 \
      | tee "$OUT/bench.log" || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
