#!/usr/bin/env bash
# One call on a GPU machine gets the GPU figures and the GPU tests in a fixed priority, within one deadline
# (its missing wheels and the model carried and installed first; see docs/gpu.md "Measuring on a GPU"):
#   source .gpu/on_device.sh; EMBEDFLEET_COMMIT=<sha> bash bench/gpu_session.sh [TOTAL_S]
# Phases, most wanted first; each starts only while the deadline leaves it room and gets what is left:
#   1. the host path: split serving with the null engine, 1 / 4 / 8 fronts (bench/split_serving.py)  split.log
#      and the engine process' CPU per input (bench/engine_path.py)                 engine_path.log
#   2. the server against sentence-transformers: MiniLM bf16 in one process, with 4 and 8 fronts,
#      and FP8 (the gate)                                                            bench.server.log
#   3. pytest tests/gpu: all of it (the CPU-capable tests take their CUDA paths here)  tests.log
#   4. the decoder's forward rows (bf16, torchao float8 row- and tensor-wise, ours)   bench.decoder.log
#   5. the encoder's forward rows (the bge-large shape, packed, compiled, FP8 kinds)  bench.encoder.log
#   6. the single-query latency and the profile of one server batch                 bench.latency.log
#   7. process start -> first answer for the bge-large shape and the 0.6B decoder   bench.coldstart.log
# Writes the logs, the figures (<gpu>.jsonl, every row with the commit, the machine and the command), server
# logs and a profile table under $OUT.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
total=${1:-480}
began=$(date +%s)
export EMBEDFLEET_BENCH_LOG_DIR=$OUT PYTHONPATH=runtime:operator:client:gateway
export ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16
python3 -c 'import torchao, torch; print("torchao", torchao.__version__, "torch", torch.__version__)' 2>&1 | tail -1

left() { echo $(( total - ($(date +%s) - began) )); }

# phase NAME MIN_S BUDGET_S ARGS...: the bench with BUDGET_S (capped by what is left), if MIN_S is left
phase() {
  local name=$1 min=$2 budget=$3; shift 3
  local rest; rest=$(left)
  if [ "$rest" -lt "$min" ]; then echo "phase $name skipped: ${rest}s left"; return; fi
  [ "$budget" -gt $((rest - 20)) ] && budget=$((rest - 20))
  local t0; t0=$(date +%s)
  timeout $((budget + 60)) python3 bench/gpu.py --budget-s "$budget" "$@" > "$OUT/bench.$name.log" 2>&1
  echo "phase $name exit $? after $(( $(date +%s) - t0 )) s"
}

rest=$(left)
if [ "$rest" -gt 150 ]; then  # its row goes to $OUT/split/split-serving-cpu.jsonl (the machine is in the row)
  t0=$(date +%s)
  timeout 140 python3 bench/split_serving.py --fronts 1,4,8 --server-cpus 0-11 --load-cpus 12-15 --texts 16384 \
    --rounds 3 --results-dir "$OUT/split" > "$OUT/split.log" 2>&1
  echo "split exit $? after $(( $(date +%s) - t0 )) s"
fi
if [ "$(left)" -gt 330 ]; then  # the engine process' host path per input on this machine's CPU (about 10 s)
  t0=$(date +%s)
  timeout 60 python3 bench/engine_path.py --alternations 1 --results-dir "$OUT/split" > "$OUT/engine_path.log" 2>&1
  echo "engine_path exit $? after $(( $(date +%s) - t0 )) s"
fi
phase server 150 240 --only server --filter '^minilm-(bfloat16|bfloat16-fronts4|bfloat16-fronts8|bfloat16-fronts8-engines2|fp8)$'
rest=$(left)
if [ "$rest" -gt 120 ]; then
  t0=$(date +%s)
  timeout $(( rest < 260 ? rest - 30 : 230 )) python3 -m pytest -q tests/gpu -p no:cacheprovider -rfEs \
    --timeout 100 > "$OUT/tests.log" 2>&1
  echo "tests exit $? after $(( $(date +%s) - t0 )) s"
  tail -25 "$OUT/tests.log"
else
  echo "tests skipped: ${rest}s left"
fi
phase decoder 120 150 --only forward --filter '^decoder'
phase encoder 90 110 --only forward --filter '^encoder-bge-large/packed'
phase latency 60 60 --only latency,profile
phase coldstart 90 120 --only coldstart
for f in bench/results/*.jsonl; do  # the GPU logs: the -cpu ones are not this machine's
  case $f in *-cpu.jsonl) ;; *) cp "$f" "$OUT/" ;; esac
done
grep -h '^{' "$OUT"/bench.*.log | python3 -c '
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    drop = ("gpu", "torch", "cuda", "date", "top_kernels", "batching", "commit", "cpu", "cores", "command")
    print(json.dumps({k: v for k, v in d.items() if k not in drop})[:300])
'
echo "session total $(( $(date +%s) - began )) s"
