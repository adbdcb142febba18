#!/usr/bin/env bash
# hopper_check.sh — the Hopper E-step kernel's first GPU call (issue 44): settle the design, then check the kernel.
#
#   bash benchmarks/hopper_check.sh [OUT_DIR]      # default: $OUT when set (the device tool), else outputs/hopper_check
#
# Steps, most important first; each appends its output to OUT_DIR/steps.log and its status to OUT_DIR/summary.md (two
# files: the device tool brings back at most 8), and a failing or timed-out step does not stop the next:
#   01 the GPU (nvidia-smi), the NVRTC build and its resource report           hopper_check.py build
#   02 the one-step prototype: us per Adam step at 132/264/1056 blocks (fast Adam, no Adam state, exact Adam)
#   03 the kernel: us per Adam step and tasks/s at 132..10,000 tasks, 1 and 5 shots, fast and exact Adam
#   04 one Adam step of 8 tasks: the kernel against its emulation, fused bf16 and fused fp32 on the GPU
#   05 an Nsight Compute profile of one kernel launch of 132 tasks (skipped without ncu)
#   06 today's triton engine, T = 1000, 1 shot (the baseline in the same call)          bench_putm.py
#   07 PUTM end to end, 1000 tasks x 50 EM steps, 1 shot: the kernel against fp32 fused, fused bf16 and the noise floor
#   08 the same at 5 shots
# GPU_CHECK_BUDGET (seconds, default 540) bounds the whole call: a step that cannot start with 20 s left is SKIPPED
# and each step's limit is cut to what is left. PYTHON (default python3).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE/.." || exit 2
PYTHON="${PYTHON:-python3}"
OUT_DIR="${1:-${OUT:-outputs/hopper_check}}"
BUDGET="${GPU_CHECK_BUDGET:-540}"
if [[ ! $BUDGET =~ ^[0-9]+$ ]]; then
    echo "hopper_check: GPU_CHECK_BUDGET=$BUDGET is not a whole number of seconds" >&2
    exit 2
fi
[[ "$BUDGET" == 0 ]] && BUDGET=540
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.md"
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "# hopper_check $(date -u +%Y-%m-%dT%H:%MZ)" >"$SUMMARY"
: >"$OUT_DIR/steps.log"
STATUS=0

step() {  # step NAME LIMIT COMMAND...: run with the smaller of LIMIT and what is left of the budget
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if ((left < 20)); then
        echo "| $name | SKIPPED (budget) | 0 s |" >>"$SUMMARY"
        return
    fi
    ((limit > left)) && limit=$left
    local t0=$(date +%s) code part
    part="$(mktemp /tmp/hopper_check_step.XXXXXX)"
    timeout --kill-after=5 "$limit" "$@" >"$part" 2>&1
    code=$?
    { echo "=================== $name (exit $code)"; cat "$part"; } >>"$OUT_DIR/steps.log"
    local result="ok"
    ((code == 124 || code == 137)) && result="TIMEOUT after $limit s"
    ((code != 0 && code != 124 && code != 137)) && result="FAILED ($code)"
    ((code != 0)) && STATUS=1
    echo "| $name | $result | $(($(date +%s) - t0)) s |" >>"$SUMMARY"
    echo "== $name: $result"
    tail -n 40 "$part"
    rm -f "$part"
}

echo "| step | result | seconds |" >>"$SUMMARY"
echo "|---|---|---|" >>"$SUMMARY"
step 01-build 120 bash -c "nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm,memory.total --format=csv; \
    $PYTHON -c 'import torch; print(\"torch\", torch.__version__, torch.version.cuda)'; $PYTHON benchmarks/hopper_check.py build"
step 02-prototype 90 "$PYTHON" benchmarks/hopper_check.py prototype
step 03-speed 120 "$PYTHON" benchmarks/hopper_check.py speed
step 04-gradients 90 "$PYTHON" benchmarks/hopper_check.py gradients
if command -v ncu >/dev/null; then
    step 05-ncu 120 ncu --clock-control none -k putm_e_step -c 1 --section SpeedOfLight --section WarpStateStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
        "$PYTHON" benchmarks/hopper_check.py profile
else
    echo "| 05-ncu | SKIPPED (no ncu) | 0 s |" >>"$SUMMARY"
fi
step 06-triton 120 "$PYTHON" benchmarks/bench_putm.py --device cuda --solver triton --basis cholesky --sizes 1000
step 07-agreement-1shot 150 "$PYTHON" benchmarks/hopper_check.py agreement --tasks 1000 --shots 1
step 08-agreement-5shot 150 "$PYTHON" benchmarks/hopper_check.py agreement --tasks 1000 --shots 5
cat "$SUMMARY"
exit $STATUS
