#!/usr/bin/env bash
# Sweep every strategy over the GPU counts this machine can serve and print how each
# scales against the 1-GPU baseline (ddp_train.py at world size 1).
#
#   bash run_all.sh                      # every strategy on 1, 2, 4, ... GPUs
#   bash run_all.sh --strategies ddp,pipeline --gpus 1,4 --model 350m
#
# Options (flags, or the environment variable in brackets):
#   --model M              model preset [MODEL] (default: 2.5b on GPUs of 60 GiB or more, else 350m)
#   --steps N              optimizer steps per run [STEPS] (default: 20; the first 3 are not timed)
#   --strategies a,b       subset of: ddp model_parallel pipeline hybrid fsdp tensor_parallel [STRATEGIES]
#   --gpus 1,2,4           GPU counts to try [GPUS] (default: 1, 2, 4, ... up to what the machine has)
#   --global-batch-size G  samples per step at 1 GPU [GLOBAL_BATCH] (default: 8)
#   --out DIR              results folder [OUT] (default: results/<date-time>)
#   --strong               strong scaling: keep the global batch fixed [SCALING=strong]
#   --cpu                  force the CPU fallback even where there is a GPU
#
# Weak scaling (the default): the global batch grows with the data-parallel degree only,
# so each data-parallel rank keeps the 1-GPU batch; model-parallel, pipeline and tensor-
# parallel rows keep the 1-GPU batch. With no GPU, the sweep runs the tiny model in 1-2
# CPU processes on gloo, to show the whole flow in a minute or two.
set -uo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-} STEPS=${STEPS:-} STRATEGIES=${STRATEGIES:-ddp,model_parallel,pipeline,hybrid,fsdp,tensor_parallel}
GPUS=${GPUS:-} GLOBAL_BATCH=${GLOBAL_BATCH:-8} OUT=${OUT:-results/$(date +%Y%m%d-%H%M%S)} SCALING=${SCALING:-weak} CPU=0
while [ $# -gt 0 ]; do
    case "$1" in
        --model) MODEL=$2; shift 2 ;;
        --steps) STEPS=$2; shift 2 ;;
        --strategies) STRATEGIES=$2; shift 2 ;;
        --gpus) GPUS=$2; shift 2 ;;
        --global-batch-size) GLOBAL_BATCH=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --strong) SCALING=strong; shift ;;
        --cpu) CPU=1; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "run_all.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

read -r N_GPUS GPU_GIB GPU_NAME < <(python3 -c "
import torch
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(torch.cuda.device_count(), p.total_memory // 2**30, p.name.replace(' ', '_'))
else:
    print(0, 0, 'none')")
if [ "$CPU" = 1 ] || [ "${N_GPUS:-0}" = 0 ]; then
    echo "No GPU in use: CPU fallback, tiny model in 1-2 gloo processes. The numbers show the flow, not GPU performance."
    DEVICE_ARGS=(--device cpu --num-workers 0)
    MODEL=${MODEL:-tiny} STEPS=${STEPS:-10} GPUS=${GPUS:-1,2} MAX=2 UNIT=process
else
    [ -n "$MODEL" ] || { [ "$GPU_GIB" -ge 60 ] && MODEL=2.5b || MODEL=350m; }
    DEVICE_ARGS=(--device cuda)
    STEPS=${STEPS:-20} MAX=$N_GPUS UNIT=GPU
    if [ -z "$GPUS" ]; then
        GPUS=1; n=2
        while [ $n -le "$N_GPUS" ]; do GPUS="$GPUS,$n"; n=$((n * 2)); done
        case ",$GPUS," in *",$N_GPUS,"*) ;; *) GPUS="$GPUS,$N_GPUS" ;; esac
    fi
    echo "$N_GPUS x ${GPU_NAME//_/ } ($GPU_GIB GiB): model $MODEL, $SCALING scaling, $STEPS steps per run"
fi
mkdir -p "$OUT/logs"
RESULTS="$OUT/results.jsonl" FAILURES="$OUT/failures.jsonl"
: > "$RESULTS"; : > "$FAILURES"
N_LAYERS=$(python3 -c "import common; print(common.PRESETS['$MODEL'].n_layers)") || exit 2
N_HEADS=$(python3 -c "import common; print(common.PRESETS['$MODEL'].n_heads)")

# The global batch of one strategy at n GPUs: weak scaling grows it with the data-parallel degree.
batch_for() {
    local strategy=$1 n=$2 dp=$2
    case $strategy in
        model_parallel|pipeline|tensor_parallel) dp=1 ;;
        hybrid) dp=$((n / 2)) ;;
    esac
    [ "$SCALING" = weak ] && [ "$dp" -ge 1 ] && echo $((GLOBAL_BATCH * dp)) || echo "$GLOBAL_BATCH"
}

# The flags of one strategy at n GPUs, or "skip: reason".
plan() {
    local strategy=$1 n=$2 BATCH dp
    BATCH=$(batch_for "$strategy" "$n") dp=$((n / 2))
    [ "$n" -le "$MAX" ] || { echo "skip: only $MAX ${UNIT}s here"; return; }
    case $strategy in
        ddp|fsdp) echo "" ;;
        model_parallel) [ "$n" -le "$N_LAYERS" ] && echo "" || echo "skip: more ranks than the model's $N_LAYERS blocks" ;;
        pipeline)
            # 1F1B needs at least as many micro-batches as stages; two per stage shrinks the bubble.
            if [ "$n" -gt "$N_LAYERS" ]; then echo "skip: more stages than the model's $N_LAYERS blocks"
            elif [ "$n" = 1 ]; then echo "--schedule 1f1b --micro-batches 1"
            elif [ $((BATCH % (2 * n))) = 0 ]; then echo "--schedule 1f1b --micro-batches $((2 * n))"
            elif [ $((BATCH % n)) = 0 ]; then echo "--schedule 1f1b --micro-batches $n"
            else echo "skip: global batch $BATCH does not split into $n micro-batches"; fi ;;
        hybrid)
            if [ "$n" -lt 2 ] || [ $((n % 2)) != 0 ]; then echo "skip: needs an even number of ranks (2 pipeline stages x data parallel)"
            elif [ $((BATCH / dp % 4)) = 0 ]; then echo "--pp 2 --schedule 1f1b --micro-batches 4"
            else echo "skip: global batch $BATCH does not split into $dp replicas x 4 micro-batches"; fi ;;
        tensor_parallel) [ $((N_HEADS % n)) = 0 ] && echo "" || echo "skip: $N_HEADS heads do not split over $n ranks" ;;
    esac
}

IFS=, read -r -a STRATEGY_LIST <<< "$STRATEGIES"
IFS=, read -r -a GPU_LIST <<< "$GPUS"
TOTAL=$(( ${#STRATEGY_LIST[@]} * ${#GPU_LIST[@]} )) i=0
for strategy in "${STRATEGY_LIST[@]}"; do
    for n in "${GPU_LIST[@]}"; do
        i=$((i + 1))
        if [ ! -f "${strategy}_train.py" ]; then echo "[$i/$TOTAL] $strategy x$n ... skipped: no ${strategy}_train.py"; continue; fi
        args=$(plan "$strategy" "$n") batch=$(batch_for "$strategy" "$n")
        case $args in skip:*) echo "[$i/$TOTAL] $strategy x$n ... skipped (${args#skip: })"; continue ;; esac
        log="$OUT/logs/${strategy}_x$n.log"
        printf '[%d/%d] %s x%d ... ' "$i" "$TOTAL" "$strategy" "$n"
        start=$(date +%s)
        # shellcheck disable=SC2086  # $args holds several flags
        torchrun --standalone --nproc_per_node="$n" "${strategy}_train.py" --model "$MODEL" --steps "$STEPS" \
            --global-batch-size "$batch" "${DEVICE_ARGS[@]}" --results "$RESULTS" $args > "$log" 2>&1
        status=$? seconds=$(( $(date +%s) - start ))
        if [ $status = 0 ]; then
            echo "$seconds s"
        else
            error=$(grep -m1 -E '^error: |Error: |Error\b' "$log" || tail -n 1 "$log")
            echo "FAILED after $seconds s: ${error:0:160} (log: $log)"
            python3 -c 'import json, sys; s, n, b, e, l = sys.argv[1:]; print(json.dumps({"strategy": s, "world_size": int(n), "global_batch_size": int(b), "error": e, "log": l}))' \
                "$strategy" "$n" "$batch" "$error" "$log" >> "$FAILURES"
        fi
    done
done

python3 - "$OUT" <<'PY'
"""The comparison table, from the results lines the runs wrote."""
import json
import os
import sys

from tabulate import tabulate

out = sys.argv[1]
records = [json.loads(line) for line in open(os.path.join(out, "results.jsonl"))]
failures = [json.loads(line) for line in open(os.path.join(out, "failures.jsonl"))]
ORDER = ["ddp", "model_parallel", "pipeline", "hybrid", "fsdp", "tp"]  # the article's, then the rest
STRATEGY_OF_SCRIPT = {"tensor_parallel": "tp"}
baseline = next((r for r in records if r["strategy"] == "ddp" and r["world_size"] == 1), None)


def name(strategy, world_size):
    return "single-GPU baseline" if strategy == "ddp" and world_size == 1 else strategy


def overhead(r):
    """What keeps this strategy from scaling, as it measured it."""
    if r.get("comm_pct") is not None:
        return f"comm {r['comm_pct']:.1f}"
    if r.get("bubble_pct") is not None:
        return f"bubble {r['bubble_pct']:.1f}"
    if r.get("utilisation_pct") is not None:
        return f"idle {100 - r['utilisation_pct']:.1f}"
    return "-"


rows = []
for r in records:
    speedup = r["samples_per_sec"] / baseline["samples_per_sec"] if baseline else None
    rows.append((ORDER.index(r["strategy"]) if r["strategy"] in ORDER else len(ORDER), r["world_size"], [
        name(r["strategy"], r["world_size"]), r["world_size"], r["global_batch_size"], f"{r['samples_per_sec']:.2f}",
        "-" if speedup is None else f"{speedup:.2f}x",
        "-" if speedup is None else f"{100 * speedup / r['world_size']:.0f}%",
        "-" if r["mfu"] is None else f"{r['mfu']:.1f}%",
        f"{r['peak_mem_gib']:.2f} ({r['mem_pct']:.0f}%)", overhead(r)]))
for f in failures:
    strategy = STRATEGY_OF_SCRIPT.get(f["strategy"], f["strategy"])
    rows.append((ORDER.index(strategy) if strategy in ORDER else len(ORDER), f["world_size"],
                 [name(strategy, f["world_size"]), f["world_size"], f["global_batch_size"], f"failed: {f['error'][:60]}", "-", "-", "-", "-", "-"]))
rows.sort(key=lambda row: row[:2])
headers = ["strategy", "GPUs", "global batch", "samples/s", "speedup", "efficiency", "MFU", "peak GiB (%)", "overhead %"]
table = [row for _, _, row in rows]
print()
print(tabulate(table, headers=headers, disable_numparse=True))
with open(os.path.join(out, "table.md"), "w") as f:
    f.write(tabulate(table, headers=headers, tablefmt="github", disable_numparse=True) + "\n")
if records:
    r = records[0]
    print(f"\n{r['model']} ({r['params'] / 1e6:,.1f}M parameters), {r['seq_len']} tokens per sample, torch {r['torch_version']}, "
          f"{r['gpu_name'] or 'CPU'}. Speedup: samples/s over the single-GPU baseline; efficiency: speedup / GPUs.")
print("The article (8x V100, 2.5B): DDP 3.73x on 4 and 6.31x on 8, model parallel 2.04x on 4, pipeline 2.63x on 4, "
      "hybrid 6.92x on 8; partly impossible (README, 'What the article claims'): contrast, do not fit.")
print(f"Table: {out}/table.md; results lines: {out}/results.jsonl; logs: {out}/logs/")

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit(0)
if baseline:
    fig, ax = plt.subplots(figsize=(6, 4))
    counts = sorted({r["world_size"] for r in records})
    ax.plot(counts, counts, "k--", label="ideal")
    for strategy in ORDER:
        points = sorted((r["world_size"], r["samples_per_sec"] / baseline["samples_per_sec"]) for r in records if r["strategy"] == strategy)
        if points:
            ax.plot(*zip(*points), "o-", label=strategy)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("speedup over 1 GPU")
    ax.legend()
    fig.savefig(os.path.join(out, "speedup.png"), dpi=120, bbox_inches="tight")
    print(f"Plot: {out}/speedup.png")
PY
