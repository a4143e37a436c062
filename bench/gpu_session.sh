#!/usr/bin/env bash
# One call on a GPU machine gets every GPU figure and the GPU tests (its missing wheels and the model
# carried and installed first; see docs/gpu.md "Measuring on a GPU"):
#   source .gpu/on_device.sh; bash bench/gpu_session.sh [BENCH_BUDGET_S] [TESTS_TIMEOUT_S]
# Writes bench.log, tests.log, the figures (<gpu>.jsonl), server logs and a profile table under $OUT.
# The bench runs first: its figures matter most, and tests can be rerun on their own.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
budget=${1:-270}
tests_timeout=${2:-150}
export EMBEDFLEET_BENCH_LOG_DIR=$OUT PYTHONPATH=runtime:operator:client:gateway
export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
# the image lacks the CPU-only extras (openvino, nncf): the check names them; serving on CUDA needs neither
python3 -m embedfleet.runtime.cli serve --check > "$OUT/check.log" 2>&1 || tail -3 "$OUT/check.log"
python3 -c 'import torchao, torch; print("torchao", torchao.__version__, "torch", torch.__version__)' 2>&1 | tail -1
started=$(date +%s)
timeout $((budget + 150)) python3 bench/gpu.py --budget-s "$budget" > "$OUT/bench.log" 2>&1
echo "bench exit $? after $(( $(date +%s) - started )) s"
cp bench/results/*.jsonl "$OUT/" 2>/dev/null
started=$(date +%s)
timeout "$tests_timeout" python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -x --timeout 120 \
  > "$OUT/tests.log" 2>&1
echo "tests exit $? after $(( $(date +%s) - started )) s"
tail -15 "$OUT/tests.log"
grep '^{' "$OUT/bench.log" | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    keep = {k: v for k, v in d.items() if k not in ("gpu", "torch", "cuda", "date", "top_kernels", "batching")}
    print(json.dumps(keep)[:400])
'
