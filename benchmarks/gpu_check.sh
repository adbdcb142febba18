#!/usr/bin/env bash
# gpu_check.sh — one command that checks lightning-putm on a CUDA machine and writes one markdown report.
#
#   bash benchmarks/gpu_check.sh [/path/to/PUTM]        # optional: a local checkout of RashLog/PUTM (the reference)
#
# Without a CUDA device it prints "no CUDA device: nothing to check" and exits 0. With one, it runs these steps
# in this order (most important first), each recorded (output, status, seconds) even when an earlier one failed:
#   0. the Hopper kernel's steps (issue 44: benchmarks/hopper_check.sh, in half of GPU_CHECK_BUDGET; its own files)
#   1. the CUDA tests of the fused Triton E-step kernel (solver=triton)      python -m pytest -m cuda tests/test_putm_triton.py
#   2. solver=triton, 1-shot, tasks/s at T = 1000 (+ the reference on the same GPU when a checkout is given)
#                                                                                     bench_putm.py
#   3. a profile of one steady-state E-step launch of 1000 tasks (Nsight Compute, as text: occupancy, warp stall
#      reasons, pipe and memory use; skipped without ncu)
#   4. the kernel's launches compared, the rows never timed first: warps per program and pipeline stages around
#      today's default (8 warps, 3 stages), then the earlier 1-stage launches, T = 1000, 50 EM steps each
#                                                                                   bench_putm.py --triton-*
#   5. the fastest launch of steps 2 and 4: tasks/s at T = 10000 (1 shot), at T = 1000 (+ the reference) and 10000
#      (5 shots), its cross-checks against the fp32 engine with the noise floor (1 and 5 shots); the default
#      settings as a user gets them (solver=auto, basis=auto) at T = 1000 and 10000; the reference at T = 10000
#      beside the fastest launch (with a checkout)             bench_putm.py, crosscheck_putm.py --triton-*
#   6. the other CUDA-marked tests (step 1 ran the kernel's)                  python -m pytest -m cuda
#   7. --solver compiled at T = 1000 and 10000, and the compiled engine's cross-check
#                                                                             bench_putm.py, crosscheck_putm.py
#   8. WRN-28-10 S2M2 training throughput at 84x84: fp32, bf16-mixed + channels-last, and the same compiled
#                                                                          benchmarks/bench_pretrain.py
#   and the sm_90 resource table of the kernel (compiled on the host, no GPU work; within the budget)
# GPU_CHECK_BUDGET (seconds, default 0 = none) bounds the whole check, for a GPU lent by the minute: a step that
# cannot start with 20 s left is recorded as SKIPPED, and each step's limit is cut to what is left. Under a budget
# the sweep (step 4) stops early enough to leave GPU_CHECK_RESERVE seconds (default 240) to step 5.
# It writes <GPU_CHECK_OUT>/<UTC date>-<device>.md (default outputs/gpu_check/), whose path it prints, with a table
# of the launches of steps 2 and 4 by tasks/s, the fastest first. The exit
# status is 0 only if every step ran and passed.
#
# Environment: PUTM_REFERENCE (same as the argument), GPU_CHECK_OUT (report folder), GPU_CHECK_WHEELS (a folder
# of wheels to install first when a needed package is missing; default .whl — see benchmarks/gpu_wheels.sh),
# GPU_CHECK_STEP_TIMEOUT (seconds per step, default 300), GPU_CHECK_BUDGET (seconds in all, default 0: no
# limit), GPU_CHECK_RESERVE (see above), PYTHON (default python3).
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
RESERVE="${GPU_CHECK_RESERVE:-240}"
for SETTING in "GPU_CHECK_STEP_TIMEOUT=$STEP_TIMEOUT" "GPU_CHECK_BUDGET=$BUDGET" "GPU_CHECK_RESERVE=$RESERVE"; do
    if [[ ! ${SETTING#*=} =~ ^[0-9]+$ ]]; then
        echo "gpu_check: $SETTING is not a whole number of seconds; set it to one (e.g. GPU_CHECK_BUDGET=540)" >&2
        exit 2
    fi
done
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
# Issue 44 first: the Hopper kernel's design-settling steps (benchmarks/hopper_check.sh), within half of this budget
# (540 s without one); their summary.md and steps.log go to GPU_CHECK_HOPPER_OUT (default outputs/hopper_check).
# GPU_CHECK_HOPPER=0 skips them, and so does GPU_CHECK_ASSUME_GPU=1 (the tests' stand-in Python cannot run them).
if [[ "${GPU_CHECK_HOPPER:-1}" == 1 && "${GPU_CHECK_ASSUME_GPU:-0}" != 1 ]]; then
    GPU_CHECK_BUDGET=$((BUDGET > 0 ? BUDGET / 2 : 540)) PYTHON="$PYTHON" bash "$HERE/hopper_check.sh" \
        "${GPU_CHECK_HOPPER_OUT:-outputs/hopper_check}" || FAILED=$((FAILED + 1))
fi

ROWS="$(mktemp /tmp/gpu_check_rows.XXXXXX)"
SWEEP="$(mktemp /tmp/gpu_check_sweep.XXXXXX)"
STEP_RESULT=""  # the last step's result: passed, FAILED (…) or SKIPPED
KEEP=0  # seconds at the end of the budget that run_step leaves alone (the sweep keeps them for the steps after it)

# run_step TITLE FORMAT COMMAND...: runs it under the step timeout, shows its output live, and records it
# (FORMAT=row: a passing run's markdown table row joins the throughput table; text: the output in a code block).
run_step() {
    local title="$1" format="$2"
    shift 2
    local limit=$STEP_TIMEOUT
    if [[ $BUDGET -gt 0 ]]; then
        local left=$((BUDGET - (SECONDS - CHECK_START) - KEEP))
        if [[ $left -lt 20 ]]; then
            local why="budget of $BUDGET s spent"
            [[ $KEEP -gt 0 ]] && why="the budget's last $KEEP s are kept for the fastest launch's steps"
            echo "=== $title: SKIPPED ($why)"
            echo "| $title | SKIPPED ($why) | 0 |" >>"$SUMMARY"
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
# A kernel launch, as the sweep names it: warps per program, pipeline stages. The default is PUTMSettings'
# triton_warps and triton_stages (tests/test_putm_triton.py holds them equal):
DEFAULT_VARIANT="8 3"
# variant_args VARIANT: its bench_putm.py and crosscheck_putm.py flags, in VARIANT_ARGS; its name, in VARIANT_NAME
variant_args() {
    local warps stages
    read -r warps stages <<<"$1"
    VARIANT_ARGS=(--triton-warps "$warps" --triton-stages "$stages")
    VARIANT_NAME="warps=$warps stages=$stages"
}
# sweep_row VARIANT LABEL: the last step's tasks/s (bench_putm.py's "ours cuda 1000 chunks seconds tasks/s …" line)
# as a row of the sweep's table; the fastest passing launch so far becomes BEST_VARIANT
BEST_VARIANT="$DEFAULT_VARIANT"
BEST_RATE=0
sweep_row() {
    local warps stages rate="—"
    read -r warps stages <<<"$1"
    [[ $STEP_RESULT == passed ]] && rate="$(awk '$1 == "ours" && $3 == 1000 {print $6; exit}' "$LOG")"
    echo "| $warps$2 | $stages | ${rate:-—} | ${STEP_RESULT%% (*} |" >>"$SWEEP"
    if [[ -n "$rate" && $rate != — ]] && awk -v a="$rate" -v b="$BEST_RATE" 'BEGIN {exit !(a + 0 > b + 0)}'; then
        BEST_VARIANT="$1"
        BEST_RATE="$rate"
    fi
}
# 1-2: the fused Triton kernel's CUDA tests, then its default launch at 1 shot, T = 1000 (+ the reference on
#    the same GPU when a checkout is given): the sweep's first row
run_step "Triton kernel: CUDA tests" text "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider tests/test_putm_triton.py
run_step "PUTM solver, --solver triton, 1-shot, T = 1000" text "${TRITON[@]}" --sizes 1000 "${REFERENCE_ARGS[@]}"
sweep_row "$DEFAULT_VARIANT" " (default)"
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
# 4: the launches compared (T = 1000, the full 50 EM steps; the warm-up compiles each build, untimed), the rows
#    never timed first, since a short slot drops the last ones: 4 warps with 3 stages (4 warps gained 11% over 8 at
#    1 stage in the H100 sweep of docs/lab/gpu-kernel.md, and two 4-warp programs share an SM), 4 stages with 8 and
#    4 warps, 2 stages, 16 warps; last the two 1-stage launches timed before, again for the ratios in the same
#    session. Under a budget the sweep leaves GPU_CHECK_RESERVE seconds to step 5.
[[ $BUDGET -gt 0 ]] && KEEP=$RESERVE
for VARIANT in "4 3" "8 4" "4 4" "8 2" "16 3" "4 1" "8 1"; do
    variant_args "$VARIANT"
    run_step "Triton sweep $VARIANT_NAME" text "${TRITON[@]}" --sizes 1000 "${VARIANT_ARGS[@]}"
    sweep_row "$VARIANT" ""
done
KEEP=0
# 5: the sweep's fastest launch (the default if no row beat it) for the issue's numbers: T = 10,000 at 1 and 5 shots
#    (+ the reference at T = 1000, 5 shots), peak memory, its cross-checks against the fp32 engine; the default
#    settings end to end (solver=auto, basis=auto: no flags); then the reference at T = 10,000 (the first thing a
#    short slot drops: the H100's is in docs/lab/gpu-kernel.md)
variant_args "$BEST_VARIANT"
BEST=("${TRITON[@]}" "${VARIANT_ARGS[@]}")
BEST_NAME="$VARIANT_NAME"
run_step "PUTM solver, --solver triton (fastest: $BEST_NAME), 1-shot, T = 10000" text "${BEST[@]}" --sizes 10000 \
    "${BIG[@]}"
run_step "PUTM solver, --solver triton (fastest: $BEST_NAME), 5-shot" text "${BEST[@]}" --sizes 1000 10000 \
    --shots 5 "${BIG[@]}" "${REFERENCE_ARGS[@]}"
for SHOTS in 1 5; do
    run_step "Triton (fastest: $BEST_NAME) vs fp32 engine, $SHOTS-shot" text "$PYTHON" benchmarks/crosscheck_putm.py \
        --device cuda --tasks 1000 --solver triton --shots "$SHOTS" "${VARIANT_ARGS[@]}"
done
run_step "PUTM solver, default settings (solver=auto, basis=auto)" text "${BENCH[@]}" --sizes 1000 10000 "${BIG[@]}"
if [[ -n "$REFERENCE" ]]; then  # the ratio at T = 10,000 in one table (ours runs again: a second measurement)
    run_step "PUTM reference and the fastest launch ($BEST_NAME), T = 10000" text "${BEST[@]}" --sizes 10000 \
        "${BIG[@]}" "${REFERENCE_ARGS[@]}" --reference-max-tasks 10000
fi
# 6: every other CUDA test (step 1 ran the kernel's)
run_step "CUDA-marked tests (besides step 1's)" text "$PYTHON" -m pytest -m cuda -q -p no:cacheprovider \
    --ignore=tests/test_putm_triton.py
# 7: the compiled engine, for the ratio in the same session
run_step "PUTM solver, --solver compiled" text "${BENCH[@]}" --sizes 1000 10000 --solver compiled
if [[ -f benchmarks/crosscheck_putm.py ]]; then
    run_step "Compiled engine vs fp32 engine" text "$PYTHON" benchmarks/crosscheck_putm.py --device cuda --tasks 1000
else
    echo "| Compiled engine vs fp32 engine | FAILED (benchmarks/crosscheck_putm.py not found) | 0 |" >>"$SUMMARY"
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
    if [[ $BEST_RATE == 0 ]]; then
        echo "No launch gave a rate; the steps titled \"fastest: …\" ran the default, $BEST_NAME."
    else
        echo "The steps titled \"fastest: …\" ran the fastest launch, $BEST_NAME ($BEST_RATE tasks/s)."
    fi
    echo
    echo "| warps | stages | tasks/s | result |"
    echo "|---|---|---|---|"
    sort -t '|' -k 4 -g -r "$SWEEP"
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
