#!/usr/bin/env bash
# gpu_check.sh — one command that checks lightning-putm on a CUDA machine and writes one markdown report.
#
#   bash benchmarks/gpu_check.sh [/path/to/PUTM]        # optional: a local checkout of RashLog/PUTM (the reference)
#
# Without a CUDA device it prints "no CUDA device: nothing to check" and exits 0. With one, it runs these steps
# in this order (most important first), each recorded (output, status, seconds) even when an earlier one failed:
#   1. the CUDA tests of the fused Triton E-step kernel (solver=triton)      python -m pytest -m cuda tests/test_putm_triton.py
#   2. solver=triton, 1-shot, tasks/s at T = 1000 (+ the reference on the same GPU when a checkout is given) and 10000,
#      then its cross-check against the fp32 engine with the noise floor     bench_putm.py, crosscheck_putm.py
#   3. a profile of one steady-state E-step launch of 1000 tasks (Nsight Compute, as text: occupancy, warp stall
#      reasons, pipe and memory use; skipped without ncu)
#   4. the kernels compared: the chunked kernel (measured first, 2026-11-27) and the wide kernel's configurations
#      (pair tile, warps, exact or fast Adam, register cap, pipeline stages), T = 1000, 50 EM steps each
#                                                                                     bench_putm.py --triton-*
#   5. solver=triton, 5-shot: tasks/s at T = 1000 (+ the reference) and 10000, and its cross-check
#   6. all CUDA-marked tests                                                  python -m pytest -m cuda
#   7. the default solver (compiled) at T = 1000 and 10000, --solver compiled, the reference at T = 10000, and the
#      fast path's cross-check                                               bench_putm.py, crosscheck_putm.py
#   8. WRN-28-10 S2M2 training throughput at 84x84: fp32, bf16-mixed + channels-last, and the same compiled
#                                                                          benchmarks/bench_pretrain.py
#   and the sm_90 resource table of the kernel (compiled on the host, no GPU work; within the budget)
# GPU_CHECK_BUDGET (seconds, default 0 = none) bounds the whole check, for a GPU lent by the minute: a step that
# cannot start with 20 s left is recorded as SKIPPED, and each step's limit is cut to what is left.
# It writes <GPU_CHECK_OUT>/<UTC date>-<device>.md (default outputs/gpu_check/), whose path it prints, with a table
# of step 4's configurations by tasks/s, the fastest first. The exit
# status is 0 only if every step ran and passed.
#
# Environment: PUTM_REFERENCE (same as the argument), GPU_CHECK_OUT (report folder), GPU_CHECK_WHEELS (a folder
# of wheels to install first when a needed package is missing; default .whl — see benchmarks/gpu_wheels.sh),
# GPU_CHECK_STEP_TIMEOUT (seconds per step, default 300), GPU_CHECK_BUDGET (seconds in all, default 0: no
# limit), PYTHON (default python3).
# Python packages needed beyond torch: pytorch-lightning, omegaconf (+ antlr4-python3-runtime for omegaconf < 2.4), optuna,
# scikit-learn, matplotlib, timm, tqdm, pyyaml, pytest, hypothesis. wandb is not needed here.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
cd "$ROOT" || exit 2
PYTHON="${PYTHON:-python3}"
REFERENCE="${1:-${PUTM_REFERENCE:-}}"
OUT_DIR="${GPU_CHECK_OUT:-outputs/gpu_check}"
WHEELS="${GPU_CHECK_WHEELS:-.whl}"
STEP_TIMEOUT="${GPU_CHECK_STEP_TIMEOUT:-300}"
BUDGET="${GPU_CHECK_BUDGET:-0}"
COMMAND="bash benchmarks/gpu_check.sh [/path/to/PUTM]"

no_gpu() {
    echo "no CUDA device: nothing to check"
    echo "on a machine with a CUDA GPU, from the repository root, run: $COMMAND"
    exit 0
}

# ------------------------------------------------------------------------------------------------ is there a GPU?
# Cheap answers first (no Python start-up): GPUs hidden, or no NVIDIA device node at all (Linux; /dev/dxg: WSL).
if [[ "${CUDA_VISIBLE_DEVICES-unset}" == "" || "${CUDA_VISIBLE_DEVICES-unset}" == "-1" ]]; then
    no_gpu
fi
# GPU_CHECK_ASSUME_GPU=1 skips this look at /dev (the tests use it to run the report logic with a stand-in Python)
if [[ "${GPU_CHECK_ASSUME_GPU:-0}" != 1 ]] && ! compgen -G "/dev/nvidia[0-9]*" >/dev/null && [[ ! -e /dev/dxg ]]; then
    no_gpu
fi
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    no_gpu
fi

# ------------------------------------------------------------------------------------------------ packages
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
NEEDED="pytorch_lightning omegaconf optuna sklearn matplotlib timm tqdm yaml pytest hypothesis"
missing() {
    "$PYTHON" - "$@" <<'EOF'
import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))
EOF
}
MISSING="$(missing $NEEDED)"
if [[ -n "$MISSING" && -d "$WHEELS" ]]; then
    SITE="$(mktemp -d /tmp/gpu_check_site.XXXXXX)"
    echo "installing the wheels of $WHEELS into $SITE (missing: $MISSING)"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:$SITE"
    MISSING="$(missing $NEEDED)"
fi

DEVICE_NAME="$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name(0))")"
TORCH_VERSION="$("$PYTHON" -c "import torch; print(torch.__version__, 'CUDA', torch.version.cuda)")"
SLUG="$(echo "$DEVICE_NAME" | tr -cs 'A-Za-z0-9' '-' | sed 's/^-*//; s/-*$//')"
mkdir -p "$OUT_DIR" || exit 2
REPORT="$OUT_DIR/$(date -u +%Y-%m-%d_%H-%M)-$SLUG.md"
BODY="$(mktemp /tmp/gpu_check_body.XXXXXX)"
SUMMARY="$(mktemp /tmp/gpu_check_summary.XXXXXX)"
LOG="$(mktemp /tmp/gpu_check_log.XXXXXX)"
FAILED=0
SKIPPED=0
CHECK_START=$SECONDS

ROWS="$(mktemp /tmp/gpu_check_rows.XXXXXX)"
SWEEP="$(mktemp /tmp/gpu_check_sweep.XXXXXX)"
STEP_RESULT=""  # the last step's result: passed, FAILED (…) or SKIPPED

# run_step TITLE FORMAT COMMAND...: runs it under the step timeout, shows its output live, and records it
# (FORMAT=row: a passing run's markdown table row joins the throughput table; text: the output in a code block).
run_step() {
    local title="$1" format="$2"
    shift 2
    local limit=$STEP_TIMEOUT
    if [[ $BUDGET -gt 0 ]]; then
        local left=$((BUDGET - (SECONDS - CHECK_START)))
        if [[ $left -lt 20 ]]; then
            echo "=== $title: SKIPPED (GPU_CHECK_BUDGET=$BUDGET s spent)"
            echo "| $title | SKIPPED (budget of $BUDGET s spent) | 0 |" >>"$SUMMARY"
            SKIPPED=1
            STEP_RESULT="SKIPPED"
            return
        fi
        [[ $left -lt $limit ]] && limit=$left
    fi
    echo "=== $title: $*"
    local start=$SECONDS status
    timeout "$limit" "$@" 2>&1 | tee "$LOG"
    status=${PIPESTATUS[0]}
    local seconds=$((SECONDS - start)) result="passed"
    if [[ $status -ne 0 ]]; then
        result="FAILED (exit $status$([[ $status -eq 124 ]] && echo ", timed out after ${limit} s"))"
        FAILED=1
    fi
    echo "| $title | $result | $seconds |" >>"$SUMMARY"
    STEP_RESULT="$result"
    {
        echo "## $title"
        echo
        echo "\`$*\` — $result in $seconds s"
        echo
        if [[ "$format" == row && $status -eq 0 ]]; then
            grep '^|' "$LOG" | tee -a "$ROWS"
        else
            echo '```'
            tail -n 200 "$LOG"
            echo '```'
        fi
        echo
    } >>"$BODY"
}

if [[ -n "$MISSING" ]]; then
    echo "| Python packages | FAILED (missing: $MISSING; see benchmarks/gpu_wheels.sh) | 0 |" >>"$SUMMARY"
    FAILED=1
fi

REFERENCE_ARGS=()
if [[ -n "$REFERENCE" ]]; then
    REFERENCE_ARGS=(--reference "$REFERENCE")
fi
BENCH=("$PYTHON" benchmarks/bench_putm.py --device cuda)
TRITON=("${BENCH[@]}" --solver triton --basis cholesky)
BIG=(--stream-tasks 10000 --memory-budget-mb 32768)
# 1-2: the fused Triton kernel, 1 shot
run_step "Triton kernel: CUDA tests" text "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider tests/test_putm_triton.py
run_step "PUTM solver, --solver triton, 1-shot, T = 1000" text "${TRITON[@]}" --sizes 1000 "${REFERENCE_ARGS[@]}"
run_step "PUTM solver, --solver triton, 1-shot, T = 10000" text "${TRITON[@]}" --sizes 10000 "${BIG[@]}"
run_step "Triton vs fp32 engine, 1-shot" text "$PYTHON" benchmarks/crosscheck_putm.py --device cuda --tasks 1000 \
    --solver triton --shots 1
# 3: where an E-step's time goes (before the sweep, so that a short slot still gets it): the 6th launch of the
#    E-step kernel, the 4th of the timed run (the warm-up's two and the first E-steps' passed)
if command -v ncu >/dev/null; then
    run_step "Triton kernel: Nsight Compute profile of one E-step of 1000 tasks" text ncu --launch-skip 5 \
        --launch-count 1 -k regex:e_step_kernel --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
        "${TRITON[@]}" --sizes 1000 --em-steps 5
else
    echo "| Triton kernel: Nsight Compute profile | SKIPPED (no ncu on PATH) | 0 |" >>"$SUMMARY"
fi
# 4: the kernels and their configurations compared (T = 1000, the full 50 EM steps; the warm-up compiles each
#    kernel, untimed): the chunked kernel measured on 2026-11-27 first, for the ratio in the same session, then
#    the wide kernel's most telling variants (approximate Adam; more warps per SM: registers capped at 128 for two
#    8-warp programs per SM; the next pair tile's loads overlapping the current tile's products: 2 pipeline
#    stages; 16-warp and 4-warp programs; fewest barriers: pair tiles of 128), those the sm_90 estimate rates
#    worse last. Fields: kernel, BLOCK_P, BLOCK_K, warps, Adam, register cap (- for none), pipeline stages
for VARIANT in "chunked 32 16 8 exact - 1" "wide 32 16 8 fast - 1" "wide 32 16 8 exact 128 1" \
    "wide 32 16 8 exact - 2" "wide 32 16 16 exact - 1" "wide 32 16 4 exact - 1" "wide 128 16 8 exact - 1" \
    "wide 16 16 8 exact - 1" "wide 32 16 8 exact 128 2" "wide 32 16 8 exact - 3" "wide 32 16 4 exact 128 1" \
    "wide 64 16 8 exact - 1" "chunked 64 16 8 exact - 1" "chunked 32 16 4 exact - 1"; do
    read -r KERNEL BLOCK_P BLOCK_K WARPS ADAM CAP STAGES <<<"$VARIANT"
    CAP_ARGS=()
    [[ $CAP != - ]] && CAP_ARGS=(--triton-max-registers "$CAP")
    run_step "Triton sweep $KERNEL BLOCK_P=$BLOCK_P$([[ $KERNEL == chunked ]] && echo " BLOCK_K=$BLOCK_K") \
warps=$WARPS Adam=$ADAM$([[ $CAP != - ]] && echo " registers<=$CAP")$([[ $STAGES != 1 ]] && echo " stages=$STAGES")" \
        text "${TRITON[@]}" --sizes 1000 --triton-kernel "$KERNEL" --triton-block-p "$BLOCK_P" \
        --triton-block-k "$BLOCK_K" --triton-warps "$WARPS" --triton-adam "$ADAM" --triton-stages "$STAGES" \
        "${CAP_ARGS[@]}"
    # the row's tasks/s (bench_putm.py's "ours cuda 1000 chunks seconds tasks/s …" line) for the sweep's table
    RATE="—"
    [[ $STEP_RESULT == passed ]] && RATE="$(awk '$1 == "ours" && $3 == 1000 {print $6; exit}' "$LOG")"
    echo "| $KERNEL | $BLOCK_P | $([[ $KERNEL == chunked ]] && echo "$BLOCK_K" || echo —) | $WARPS | $ADAM \
| ${CAP/-/—} | $STAGES | ${RATE:-—} | ${STEP_RESULT%% (*} |" >>"$SWEEP"
done
run_step "Triton sweep, 132 persistent programs" text "${TRITON[@]}" --sizes 1000 --triton-programs 132
# 5: 5 shots
run_step "PUTM solver, --solver triton, 5-shot" text "${TRITON[@]}" --sizes 1000 10000 --shots 5 "${BIG[@]}" \
    "${REFERENCE_ARGS[@]}"
run_step "Triton vs fp32 engine, 5-shot" text "$PYTHON" benchmarks/crosscheck_putm.py --device cuda --tasks 1000 \
    --solver triton --shots 5
# 6: every CUDA test
run_step "CUDA-marked tests" text "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider
# 7: the default solver (compiled), for the ratio in the same session, and the reference at T = 10000
run_step "PUTM solver, default" text "${BENCH[@]}" --sizes 1000 10000 "${BIG[@]}"
run_step "PUTM solver, --solver compiled" text "${BENCH[@]}" --sizes 1000 10000 --solver compiled
if [[ -n "$REFERENCE" ]]; then
    run_step "PUTM reference, T = 10000" text "${TRITON[@]}" --sizes 10000 "${BIG[@]}" "${REFERENCE_ARGS[@]}" \
        --reference-max-tasks 10000
fi
if [[ -f benchmarks/crosscheck_putm.py ]]; then
    run_step "Fast path vs fp32 engine" text "$PYTHON" benchmarks/crosscheck_putm.py --device cuda --tasks 1000
else
    echo "| Fast path vs fp32 engine | FAILED (benchmarks/crosscheck_putm.py not found) | 0 |" >>"$SUMMARY"
    FAILED=1
fi
# 8: pretraining throughput
PRETRAIN=("$PYTHON" benchmarks/bench_pretrain.py --device cuda --backbone wrn28_10 --image-size 84 --batch-size 64
          --no-header)
run_step "WRN-28-10 S2M2 training, fp32" row "${PRETRAIN[@]}" --precision 32-true
run_step "WRN-28-10 S2M2 training, bf16-mixed + channels-last" row "${PRETRAIN[@]}" --precision bf16-mixed \
    --channels-last
run_step "WRN-28-10 S2M2 training, bf16-mixed + channels-last + compile" row "${PRETRAIN[@]}" \
    --precision bf16-mixed --channels-last --compile
# the kernel's sm_90 resources: compiled on the host (CPU time only), last. Within the budget like every step: on
# a lent machine its minutes (cold compile cache) count too, and a check cut off by the caller's time limit would
# lose the whole report
run_step "Triton kernel: sm_90 resources (ptxas)" text "$PYTHON" benchmarks/bench_putm.py --sm90-resources

{
    echo "# gpu_check: $DEVICE_NAME"
    echo
    echo "- date (UTC): $(date -u '+%Y-%m-%d %H:%M')"
    echo "- device: $DEVICE_NAME ($(nvidia-smi --query-gpu=memory.total,driver_version --format=csv,noheader 2>/dev/null \
        | head -n 1 || echo 'nvidia-smi not available'))"
    echo "- torch: $TORCH_VERSION"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git status --porcelain 2>/dev/null \
        | grep -q . && echo ' (with uncommitted changes)')"
    echo "- reference implementation: ${REFERENCE:-not given (pass a RashLog/PUTM checkout to compare)}"
    echo
    echo "| step | result | seconds |"
    echo "|---|---|---|"
    cat "$SUMMARY"
    echo
    echo "## Triton kernel sweep (1-shot, bf16, T = 1000, 50 EM steps, tasks/s; the fastest first)"
    echo
    echo "| kernel | BLOCK_P | BLOCK_K | warps | Adam | register cap | stages | tasks/s | result |"
    echo "|---|---|---|---|---|---|---|---|---|"
    sort -t '|' -k 9 -g -r "$SWEEP"
    echo
    echo "## WRN-28-10 S2M2 training throughput (s2m2r step, 84x84, batch 64, synthetic images)"
    echo
    "$PYTHON" benchmarks/bench_pretrain.py --header-only
    cat "$ROWS"
    echo
    cat "$BODY"
} >"$REPORT.tmp" && mv "$REPORT.tmp" "$REPORT"
rm -f "$BODY" "$SUMMARY" "$LOG" "$ROWS" "$SWEEP"

echo
echo "report: $REPORT"
if [[ $FAILED -ne 0 ]]; then
    echo "gpu_check: some steps FAILED (see the report)"
    exit 1
fi
if [[ $SKIPPED -ne 0 ]]; then
    echo "gpu_check: the steps that ran passed; some were SKIPPED for GPU_CHECK_BUDGET (see the report)"
    exit 1
fi
echo "gpu_check: all steps passed"
