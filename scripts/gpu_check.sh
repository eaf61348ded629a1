#!/usr/bin/env bash
# The whole GPU check in one command, on a CUDA machine from a checkout of this repository:
#   bash scripts/gpu_check.sh [tests] [rows] [breakdown] [profile] [bench-seed] [bench-trained] [bench-sweep] [bench-losses]
#                             [bench-softonly] [memory] [bench-topk] [bench-logits] [bench-teacher-topk]
#                             [bench-softcap] [bench-trl] [bench-trl-step] [bench-trl-onpolicy] [bench-fp8]
#                             [dist-one-gpu] [cute] [bench-models] [bench-divergences] [bench-verl]
#                             [bench-axolotl] [bench-teachers] [overlap] [rows-in-gemm] [akl-head]
# (default: all of them, about 20 minutes on an H200; each of the last five a minute or two, bench-trl-step
# at most about five: it needs trl 1.16.0 and accelerate (from .whl/); no PYTHONPATH beyond this script's, as
# benchmarks/bench_trl_step.py falls back to its own stand-in for `datasets` where that is not installed;
# bench-trl-onpolicy the same, a few minutes: TRL's on-policy loss vs the patch, and AsyncDistillationTrainer steps;
# dist-one-gpu: the vocab-parallel Triton rows over NCCL at world size 1 and over gloo ranks sharing the GPU)
# Logs and results go to $OUT (default ./gpu-out). Liger-Kernel is installed from .whl/ when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/flashkd-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/flashkd-site"
fi
stages=${*:-tests rows breakdown profile bench-seed bench-trained bench-sweep bench-losses bench-divergences bench-softonly memory bench-topk bench-logits bench-teacher-topk bench-softcap bench-trl bench-trl-step bench-trl-onpolicy bench-fp8 dist-one-gpu}
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
echo "commit ${FLASHKD_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" | tee -a "$OUT/env.txt"  # the device copy has no .git: pass the full FLASHKD_COMMIT (records use it too)
for stage in $stages; do
  echo "=== $stage"
  case $stage in
    tests) { python3 -m pytest -q -m "gpu or not gpu" tests/test_gpu.py tests/test_triton_rows.py tests/test_softcap_tanh.py \
        tests/test_triton_divergences.py tests/test_triton_mixture.py tests/test_learning_teacher.py \
        && python3 -m pytest -q -m gpu tests/test_exact.py; } 2>&1 | tee "$OUT/tests.log" | tail -25 || status=1 ;;
    # a trained head's logit magnitudes (std 4, peaks 32): every provider's errors against the fp32 truth, TRL's kernel
    # on the soft term alone
    bench-trained) ( python3 -c "import datasets" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks/_datasets_stub"
      python3 -m flashkd bench --preset trained --providers flashkd trl liger floor --modes full --out "$OUT/trained" ) \
      2>&1 | tee "$OUT/bench-trained.log" || status=1 ;;
    rows) python3 benchmarks/bench_rows.py 2>&1 | tee "$OUT/rows.log" || status=1 ;;
    breakdown) python3 benchmarks/bench_breakdown.py 2>&1 | tee "$OUT/breakdown.log" || status=1 ;;
    profile) python3 benchmarks/bench_profile.py 2>&1 | tee "$OUT/profile.log" || status=1 ;;
    bench-seed) python3 -m flashkd bench --preset seed --out "$OUT/seed" 2>&1 | tee "$OUT/bench-seed.log" || status=1 ;;
    # the model families' heads (workloads.MODEL_HEADS), trained-head logits: first flashkd against the floor at every
    # head, N 8192 (benchmarks/bench_plan.py: no gate, about 2 minutes), then the checked bench with Liger and the floor
    # at N 8192 and 16384, JSD, forward KL and cosine (the gate's fp32 reference takes ~5 s a workload and Liger
    # compiles each head: tens of minutes; every loss: add --loss reverse_kl tvd)
    bench-models) { python3 benchmarks/bench_plan.py --heads "" --loss jsd forward_kl cosine --chunks auto --no-grad \
        && python3 -m flashkd bench --preset models --loss jsd forward_kl cosine --providers flashkd liger floor \
        --modes full no-grad-forward --out "$OUT/models"; } 2>&1 | tee "$OUT/bench-models.log" || status=1 ;;
    bench-sweep) python3 -m flashkd bench --preset sweep --providers flashkd liger floor --modes full no-grad-forward \
      --out "$OUT/sweep" 2>&1 | tee "$OUT/bench-sweep.log" || status=1 ;;
    bench-losses) python3 -m flashkd bench --preset seed -n 8192 --loss forward_kl reverse_kl tvd --providers flashkd floor \
      --modes full no-grad-forward --out "$OUT/losses" 2>&1 | tee "$OUT/bench-losses.log" || status=1 ;;
    # every divergence beside JSD at the seed, orda-kernel 0.1.0 (from .whl/) beside flashkd where it has the loss
    # (its fused Triton path on the GPU; tvd, akl and the cosine are not among its losses) (the dense rows of AKL run on the torch
    # definition for now, the rest in the Triton kernel), and on a top-k teacher (the Triton backend's passes, the
    # categories' math in torch for all but JSD and the KLs)
    bench-divergences) { python3 -m flashkd bench --preset seed -n 8192 --loss jsd forward_kl skew_kl skew_reverse_kl \
      jeffreys triangular alpha_divergence renyi renyi_reverse ab_divergence entropy_adaptive dkd akl \
      --providers flashkd orda floor --modes full --out "$OUT/divergences" \
      && python3 -m flashkd bench --preset topk --loss jsd skew_kl skew_reverse_kl jeffreys alpha_divergence akl \
      --providers flashkd floor --modes full --out "$OUT/divergences-topk"; } 2>&1 | tee "$OUT/bench-divergences.log" || status=1 ;;
    bench-softonly) python3 -m flashkd bench --preset seed -n 8192 --loss jsd --weight-hard 0 --weight-soft 1 \
      --providers flashkd liger floor --modes full --out "$OUT/softonly" 2>&1 | tee "$OUT/bench-softonly.log" || status=1 ;;
    memory) python3 benchmarks/bench_memory.py 2>&1 | tee "$OUT/memory.log" || status=1 ;;
    bench-topk) python3 -m flashkd bench --preset topk --out "$OUT/topk" 2>&1 | tee "$OUT/bench-topk.log" || status=1 ;;
    bench-logits) python3 -m flashkd bench --preset logits --out "$OUT/logits" 2>&1 | tee "$OUT/bench-logits.log" || status=1 ;;
    bench-teacher-topk) python3 -m flashkd bench --preset teacher-topk --modes no-grad-forward --out "$OUT/teacher-topk" \
      2>&1 | tee "$OUT/bench-teacher-topk.log" || status=1 ;;
    bench-softcap) python3 -m flashkd bench --preset seed -n 8192 --loss jsd --providers flashkd torch floor \
      --modes full no-grad-forward --softcap 30 --out "$OUT/softcap" 2>&1 | tee "$OUT/bench-softcap.log" || status=1 ;;
    # TRL's kernel module imports `datasets` (names only): where it is missing, the benchmark's stand-in serves
    bench-trl) ( python3 -c "import datasets" 2>/dev/null || export PYTHONPATH="$PYTHONPATH:$PWD/benchmarks/_datasets_stub"
      python3 -m flashkd bench --preset seed -n 8192 --loss jsd --weight-hard 0 --weight-soft 1 \
      --providers flashkd trl liger floor --modes full --out "$OUT/trl" ) 2>&1 | tee "$OUT/bench-trl.log" || status=1 ;;
    # a whole DistillationTrainer step, TRL's loss vs flashkd's patch: first with pre-drawn completions, then with
    # the student sampling them through transformers' generate (most of that step; bounded by timeout)
    bench-trl-step) python3 benchmarks/bench_trl_step.py --out "$OUT/trl-step" 2>&1 | tee "$OUT/bench-trl-step.log" || status=1
      timeout 300 python3 benchmarks/bench_trl_step.py --generation student --warmup 1 --steps 2 \
        --out "$OUT/trl-step-sampled" 2>&1 | tee "$OUT/bench-trl-step-sampled.log" || status=1 ;;
    # AsyncDistillationTrainer's loss (a served teacher's top-k) at 8192 positions, K 2 / 20 / 100, and whole
    # optimizer steps of the trainer with a stand-in rollout worker (no vLLM)
    bench-trl-onpolicy) python3 benchmarks/bench_trl_onpolicy.py --out "$OUT/trl-onpolicy" 2>&1 \
      | tee "$OUT/bench-trl-onpolicy.log" || status=1 ;;
    bench-fp8) python3 benchmarks/bench_fp8.py --out "$OUT/fp8" 2>&1 | tee "$OUT/bench-fp8.log" || status=1
      for p in fp8 fp8-1x128; do
        python3 -m flashkd bench --preset seed -n 8192 --loss jsd --providers flashkd floor --modes full no-grad-forward \
          --teacher-precision $p --out "$OUT/seed-$p" 2>&1 | tee -a "$OUT/bench-fp8.log" || status=1
      done
      python3 -m flashkd bench --preset sweep --providers flashkd floor --modes full --teacher-precision fp8 \
        --out "$OUT/sweep-fp8" 2>&1 | tee -a "$OUT/bench-fp8.log" || status=1
      python3 -m flashkd bench --preset teacher-topk --modes no-grad-forward --providers flashkd floor --teacher-precision fp8 \
        --out "$OUT/teacher-topk-fp8" 2>&1 | tee -a "$OUT/bench-fp8.log" || status=1 ;;
    # the vocab-parallel Triton rows on one GPU: NCCL at world size 1, and gloo ranks sharing the GPU (world 2, 3);
    # then the sharded call at world size 1 against the unsharded one, and its collectives' bytes against the formula.
    # FSDP2 is not run over gloo on a shared GPU: there a rank segfaults inside torch's DTensor.full_tensor (the
    # test's own gather of the parameters, functional collectives over gloo on CUDA; BENCHMARKS.md). Its tests run
    # on CPU gloo and, on two GPUs, in scripts/gpu_dist_check.sh
    dist-one-gpu) { FLASHKD_DIST_BACKEND=nccl python3 -m pytest -q tests/test_distributed.py -k "triton and 1-float32" \
        && FLASHKD_DIST_DEVICE=cuda python3 -m pytest -q tests/test_distributed.py -k "vocab_parallel_triton and not 1-float32" \
        && torchrun --standalone --nproc_per_node=1 benchmarks/bench_dist.py --out "$OUT/dist-one-gpu.json"; } 2>&1 \
      | tee "$OUT/dist-one-gpu.log" || status=1 ;;
    # CuTe DSL on this GPU (not in the default stages): installs the carried .cute/ (bash ../shared/device/cute-payload.sh
    # packs it) when the package is missing, then backend "cute": its GEMM's compile with an empty disk cache and its load from it in a second process, the GEMM against
    # cuBLAS (and its dW GEMM against cuBLAS's fp32 addmm), its exactness (the GPU tests of tests/test_exact.py), its
    # time at the seed (and kernel by kernel) and over the N sweep
    cute) ( python3 -c "import cutlass.cute" 2>/dev/null || { bash .cute/install.sh \
        && export PYTHONPATH="$PYTHONPATH:/tmp/cute:/tmp/cute/nvidia_cutlass_dsl/dsl_packages"; }
      export CUTE_DSL_CACHE_DIR=/tmp/flashkd-cute-cache FLASHKD_CACHE_DIR=/tmp/flashkd-cache
      rm -rf "$CUTE_DSL_CACHE_DIR" "$FLASHKD_CACHE_DIR"
      for first in cold warm; do timeout 120 python3 probes/probe_cute_gemm.py --compile-only; done  # the disk cache
      timeout 300 python3 probes/probe_cute_gemm.py --reps 20 --out "$OUT/cute-gemm.json" \
        ; python3 -m pytest -q -m gpu tests/test_exact.py -p no:cacheprovider \
        ; python3 -m flashkd bench --preset seed -n 8192 --loss jsd tvd forward_kl --providers flashkd-triton flashkd-cute floor \
          --modes full --out "$OUT/cute-seed" \
        ; python3 benchmarks/bench_profile.py --providers floor flashkd-triton flashkd-cute --modes full --steps 5 \
        ; python3 -m flashkd bench --preset sweep --providers flashkd-triton flashkd-cute floor --modes full \
          --out "$OUT/cute-sweep" ) 2>&1 | tee "$OUT/cute.log" || status=1 ;;
    # verl's top-k distillation loss (its own path, bf16 logits) against flashkd's integration (its predicted, fallback
    # and unpredicted backward) and its top-k form, 32768 / 65536 tokens, K 32 / 128, with the integration's time split;
    # axolotl's Liger-based top-k KD loss against flashkd's drop-in, without and with the CE (both need the frameworks'
    # wheels in .whl/: verl, omegaconf, antlr4; axolotl, peft, addict, pydantic and its packages)
    bench-verl) python3 benchmarks/bench_verl.py --out "$OUT/verl" 2>&1 | tee "$OUT/bench-verl.log" || status=1 ;;
    bench-axolotl) { python3 benchmarks/bench_axolotl.py --out "$OUT/axolotl" \
        && python3 benchmarks/bench_axolotl.py --ce --out "$OUT/axolotl-ce"; } 2>&1 | tee "$OUT/bench-axolotl.log" || status=1 ;;
    # several teachers (routed, geometric, sum, arithmetic where flashkd has it) against the one-teacher call and
    # their GEMM floors, the exact token map against the same-vocabulary call, and GOLD's hybrid ULD loss against
    # TRL's ULDLoss (Llama-3 student <- Qwen3 teacher, 8192 aligned rows; checked first at a small shape), and a
    # teacher that learns (mutual, co_jeffreys) against its six GEMMs, a few minutes; the GOLD part needs trl 1.16.0 from .whl/ (and `datasets` or the benchmark's stand-in): where trl is
    # missing, TRL's rows are skipped with a note
    bench-teachers) python3 benchmarks/bench_teachers.py --out "$OUT/teachers" 2>&1 | tee "$OUT/bench-teachers.log" || status=1 ;;
    # the row pass beside the GEMMs on a second stream: one chunk's kernels alone, one after the other and at once
    # (also with cuBLASLt's SM carveout) — what a spare-SM split of the row pass hides (under a minute)
    overlap) { python3 probes/probe_overlap.py --rows 1024 2048 --reps 20 \
        && python3 probes/probe_overlap.py --rows 1024 --reps 15 --blas cublaslt --carveout 16 32 48; } 2>&1 \
      | grep -v "Warning: Setting the SM" | tee "$OUT/overlap.log" || status=1 ;;
    # the row pass inside the logits GEMM's CTAs (warpgroup 0's idle warps) against the GEMM alone (CuTe DSL, a minute)
    rows-in-gemm) python3 probes/probe_cute_rows.py --reps 20 2>&1 | tee "$OUT/rows-in-gemm.log" || status=1 ;;
    # AKL's head kernels alone on one chunk (trained, mixed, flat teachers), then AKL beside JSD at the seed on
    # trained-head logits (the bench's default inputs give a flat teacher: every row takes the bins)
    akl-head) { python3 benchmarks/bench_akl_head.py && python3 -m flashkd bench --preset seed -n 8192 --loss jsd akl \
        --inputs trained --providers flashkd-triton floor --modes full --out "$OUT/akl-trained"; } 2>&1 \
        | tee "$OUT/akl-head.log" || status=1 ;;
    *) echo "unknown stage $stage"; status=2 ;;
  esac
done
exit $status
