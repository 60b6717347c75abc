#!/usr/bin/env bash
# Sweep every strategy over the GPU counts this machine can serve, print how each
# scales against the 1-GPU baseline (ddp_train.py at world size 1), and write the report
# (REPORT.md and its pictures, sweep_report.py) into the sweep's folder.
#
#   bash run_all.sh                      # every strategy on 1, 2, 4, ... GPUs
#   bash run_all.sh --strategies ddp,pipeline --gpus 1,4 --model 350m
#   bash run_all.sh --simulate 2,4,8     # predict 2, 4, 8 GPUs from this one (README, 'Predicting')
#   bash run_all.sh --model 2.5b-long --seq-len 65536 --strategies context_parallel --global-batch-size 1 --gpus 1 --simulate 2,4,8
#                                        # which long sequences fit at 2, 4, 8 GPUs, from each simulated rank's memory
#
# Options (flags only: environment variables such as MODEL or OUT, which other tools
# set for their own purposes, are ignored):
#   --model M              a model preset of common.py (default: 2.5b on GPUs of 60 GiB or more, else 350m; tiny on CPU)
#   --steps N              optimizer steps per run (default: 20, 10 on CPU; the first 3 are not timed)
#   --strategies a,b       which *_train.py scripts to run (default: ddp,model_parallel,pipeline,hybrid,fsdp,tensor_parallel,context_parallel)
#   --gpus 1,2,4           GPU counts to try (default: 1, 2, 4, ... up to what the machine has; 1,2 processes on CPU)
#   --global-batch-size G  samples per step at 1 GPU (default: 8)
#   --seq-len T            tokens per sample in every run (default: the preset's context length)
#   --out DIR              results folder, new or empty (default: a new results/<date-time>-<random>)
#   --strong               strong scaling: keep the global batch fixed
#   --simulate 2,4,8       also predict these GPU counts, each distinct rank run alone here on a fake process
#                          group (default: the measured counts above 1 where there are several GPUs; none to stop)
#   --intra-gbps X         with --simulate: bus bandwidth per GPU inside a node (default: sweep_report.LINK_GBPS)
#   --inter-gbps Y         with --simulate: bus bandwidth per GPU across nodes (default: sweep_report.LINK_GBPS)
#   --gpus-per-node K      with --simulate: GPUs a node holds (default: 8)
#   --profile              trace 3 steps of every measured run with torch.profiler (left out of its timing), into OUT/profiles/<run>/
#                          (one Chrome trace and op table per rank; REPORT.md links them); needs --steps of at least 10
#   --compile              torch.compile every run's blocks
#   --float8 MODE          also run every measured row with --float8 MODE (tensorwise or rowwise), as a row of
#                          its own; on a GPU these rows are compiled (eager float8 is slower than bf16)
#   --cpu                  force the CPU fallback even where there is a GPU
#
# Weak scaling (the default): the global batch grows with the data-parallel degree only,
# so each data-parallel rank keeps the 1-GPU batch; model-parallel, pipeline, tensor-
# and context-parallel rows keep the 1-GPU batch. With no GPU, the sweep runs the tiny model in 1-2
# CPU processes on gloo, to show the whole flow in a few minutes. Every run gets
# OMP_NUM_THREADS=1, whatever the environment says, so that all rows compare alike.
set -uo pipefail
cd "$(dirname "$0")" || exit 2

# One line on stderr and exit status 2, before any run starts.
refuse() { echo "run_all.sh: $*" >&2; exit 2; }
# one_of WORD LIST...: whether WORD is one of LIST.
one_of() {
    local word=$1 item
    shift
    for item; do [ "$item" = "$word" ] && return 0; done
    return 1
}
positive='^[1-9][0-9]*$'

# Lower-case names throughout: every setting starts here or from a flag, never from the environment.
model='' steps='' seq_len='' strategies='' gpus='' global_batch=8 out='' scaling=weak cpu=0 simulate='' link_args=() compile_args=() float8='' profile=0
while [ $# -gt 0 ]; do
    case "$1" in
        --model|--steps|--seq-len|--strategies|--gpus|--global-batch-size|--out|--simulate|--intra-gbps|--inter-gbps|--gpus-per-node|--float8)
            [ $# -ge 2 ] && [ -n "$2" ] && [[ $2 != --* ]] || refuse "$1 needs a value (see --help)" ;;
    esac
    case "$1" in
        --model) model=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --seq-len) seq_len=$2; shift 2 ;;
        --strategies) strategies=$2; shift 2 ;;
        --gpus) gpus=$2; shift 2 ;;
        --global-batch-size) global_batch=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --strong) scaling=strong; shift ;;
        --cpu) cpu=1; shift ;;
        --profile) profile=1; shift ;;
        --compile) compile_args=(--compile); shift ;;
        --float8) one_of "$2" tensorwise rowwise || refuse "--float8 $2: expected tensorwise or rowwise"; float8=$2; shift 2 ;;
        --simulate) simulate=$2; shift 2 ;;
        --intra-gbps|--inter-gbps)
            [[ $2 =~ ^[0-9]*\.?[0-9]+$ ]] && [[ $2 =~ [1-9] ]] || refuse "$1 $2: expected a positive number of GB/s"
            link_args+=("$1" "$2"); shift 2 ;;
        --gpus-per-node) [[ $2 =~ $positive ]] || refuse "$1 $2: expected a positive whole number"; link_args+=("$1" "$2"); shift 2 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) refuse "unknown option $1 (see --help)" ;;
    esac
done

[ -z "$steps" ] || [[ $steps =~ $positive ]] || refuse "--steps $steps: expected a positive whole number"
# Timing skips 3 warm-up steps, the profiler's 5 (warm-up, 3 traced, its export) and the
# counted last: 10 steps leave one timed (both defaults, 10 and 20, pass).
[ "$profile" = 0 ] || [ -z "$steps" ] || [ "$steps" -ge 10 ] || refuse "--profile --steps $steps: the profiled steps are not timed, so --profile needs --steps of at least 10"
[ -z "$seq_len" ] || [[ $seq_len =~ $positive ]] || refuse "--seq-len $seq_len: expected a positive whole number"
[[ $global_batch =~ $positive ]] || refuse "--global-batch-size $global_batch: expected a positive whole number"
[ -z "$gpus" ] || [[ $gpus =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || refuse "--gpus $gpus: expected positive counts separated by commas, e.g. 1,2,4"
[ -z "$simulate" ] || [ "$simulate" = none ] || [[ $simulate =~ ^([2-9]|[1-9][0-9]+)(,([2-9]|[1-9][0-9]+))*$ ]] \
    || refuse "--simulate $simulate: expected counts of 2 or more separated by commas, e.g. 2,4,8, or none"
# The strategies this folder holds, one *_train.py each.
scripts=(*_train.py)
scripts=("${scripts[@]%_train.py}")
if [ -z "$strategies" ]; then
    for strategy in ddp model_parallel pipeline hybrid fsdp tensor_parallel context_parallel; do
        [ -f "${strategy}_train.py" ] && strategies+=${strategies:+,}$strategy
    done
fi
IFS=, read -r -a strategy_list <<< "$strategies"
for strategy in "${strategy_list[@]}"; do
    one_of "$strategy" "${scripts[@]}" || refuse "--strategies $strategies: no ${strategy}_train.py here; accepted: $(IFS=,; echo "${scripts[*]}")"
done
if [ -n "$out" ] && [ -e "$out" ]; then
    [ -d "$out" ] && [ -z "$(ls -A "$out")" ] || refuse "--out $out: exists and is not an empty folder; name a new or empty one"
fi

# What the machine has, and the model presets common.py defines.
machine=$(python3 -c "
import torch, common
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(torch.cuda.device_count(), p.total_memory // 2**30, p.name.replace(' ', '_'), *common.PRESETS)
else:
    print(0, 0, 'none', *common.PRESETS)") || exit 2
read -r n_gpus gpu_gib gpu_name preset_names <<< "$machine"
read -r -a presets <<< "$preset_names"
[ -z "$model" ] || one_of "$model" "${presets[@]}" || refuse "--model $model: not a preset of common.py; accepted: $(IFS=,; echo "${presets[*]}")"

if [ "$cpu" = 1 ] || [ "$n_gpus" = 0 ]; then
    device_args=(--device cpu --num-workers 0)
    float8_args=("${compile_args[@]}")
    model=${model:-tiny} steps=${steps:-10} gpus=${gpus:-1,2} max=2 max_label="2 processes"
    banner="No GPU in use: CPU fallback, model $model in 1-2 gloo processes, $scaling scaling, $steps steps per run. The numbers show the flow, not GPU performance."
else
    [ -n "$model" ] || { [ "$gpu_gib" -ge 60 ] && model=2.5b || model=350m; }
    device_args=(--device cuda)
    float8_args=(--compile)
    steps=${steps:-20} max=$n_gpus max_label="$n_gpus GPU"
    [ "$n_gpus" = 1 ] || max_label+=s
    if [ -z "$gpus" ]; then
        gpus=1 n=2
        while [ $n -le "$n_gpus" ]; do gpus="$gpus,$n"; n=$((n * 2)); done
        case ",$gpus," in *",$n_gpus,"*) ;; *) gpus="$gpus,$n_gpus" ;; esac
    fi
    # Where several GPUs measure, predict the same counts: every run then checks the model.
    [ -n "$simulate" ] || [ "$n_gpus" = 1 ] || simulate=${gpus#1,}
    banner="$n_gpus x ${gpu_name//_/ } ($gpu_gib GiB): model $model, $scaling scaling, $steps steps per run"
fi
[ "$simulate" != none ] || simulate=''
[ -n "$simulate" ] || [ ${#link_args[@]} = 0 ] || refuse "${link_args[0]} models the wire of predicted rows: it needs --simulate"
IFS=, read -r -a gpu_list <<< "$gpus"
IFS=, read -r -a sim_list <<< "$simulate"
# The model's shape, and which ranks of each simulated run differ (sweep_report.roles).
role_pairs=()
for strategy in "${strategy_list[@]}"; do for n in "${sim_list[@]}"; do role_pairs+=("$strategy:$n"); done; done
shape=$(python3 -c "import common; c = common.PRESETS['$model']; print(c.n_layers, c.n_heads, c.max_seq_len)") || exit 2
read -r n_layers n_heads max_seq_len <<< "$shape"
[ -z "$seq_len" ] || [ "$seq_len" -le "$max_seq_len" ] || refuse "--seq-len $seq_len: exceeds the $model preset's context of $max_seq_len (2.5b-long holds 131072)"
seq_len=${seq_len:-$max_seq_len}
echo "$banner"
declare -A roles=()
if [ ${#role_pairs[@]} -gt 0 ]; then
    while read -r strategy n rank; do roles["$strategy $n"]+="${roles["$strategy $n"]:+ }$rank"; done \
        < <(python3 sweep_report.py --roles "$model" "${role_pairs[@]}") || exit 2
fi

# A folder of its own for every sweep: mktemp makes a new one atomically, and an explicit
# --out is claimed by creating its logs/, which fails if another sweep got there first.
if [ -z "$out" ]; then
    mkdir -p results && out=$(mktemp -d "results/$(date +%Y%m%d-%H%M%S)-XXXXXX") || exit 2
fi
mkdir -p "$out" && mkdir "$out/logs" || exit 2
results="$out/results.jsonl" failures="$out/failures.jsonl"
: > "$results"; : > "$failures"

# torchrun sets OMP_NUM_THREADS=1 only when it starts more than one process, so without
# this the 1-GPU rows would run with every core and the others with one thread each.
# One thread per process for every row: on CPU, n processes then use n cores.
export OMP_NUM_THREADS=1

# The global batch of one strategy at n GPUs: weak scaling grows it with the data-parallel degree.
batch_for() {
    local strategy=$1 n=$2 dp=$2
    case $strategy in
        model_parallel|pipeline|tensor_parallel|context_parallel) dp=1 ;;
        hybrid) dp=$((n / 2)) ;;
    esac
    [ "$scaling" = weak ] && [ "$dp" -ge 1 ] && echo $((global_batch * dp)) || echo "$global_batch"
}

# The flags of one strategy at n GPUs, or "skip: reason".
plan() {
    local strategy=$1 n=$2 batch dp
    batch=$(batch_for "$strategy" "$n") dp=$((n / 2))
    [ "$n" -le "$max" ] || { echo "skip: only $max_label here"; return; }
    case $strategy in
        model_parallel) [ "$n" -le "$n_layers" ] && echo "" || echo "skip: more ranks than the model's $n_layers blocks" ;;
        pipeline)
            # 1F1B needs at least as many micro-batches as stages; two per stage shrinks the bubble.
            if [ "$n" -gt "$n_layers" ]; then echo "skip: more stages than the model's $n_layers blocks"
            elif [ "$n" = 1 ]; then echo "--schedule 1f1b --micro-batches 1"
            elif [ $((batch % (2 * n))) = 0 ]; then echo "--schedule 1f1b --micro-batches $((2 * n))"
            elif [ $((batch % n)) = 0 ]; then echo "--schedule 1f1b --micro-batches $n"
            else echo "skip: global batch $batch does not split into $n micro-batches"; fi ;;
        hybrid)
            if [ "$n" -lt 2 ] || [ $((n % 2)) != 0 ]; then echo "skip: needs an even number of ranks, 2 pipeline stages x data parallel"
            elif [ $((batch / dp % 4)) = 0 ]; then echo "--pp 2 --schedule 1f1b --micro-batches 4"
            else echo "skip: global batch $batch does not split into $dp replicas x 4 micro-batches"; fi ;;
        tensor_parallel) [ $((n_heads % n)) = 0 ] && echo "" || echo "skip: $n_heads heads do not split over $n ranks" ;;
        context_parallel) [ $((seq_len % (2 * n))) = 0 ] && echo "" || echo "skip: $seq_len tokens do not cut into 2 x $n equal chunks" ;;
        *) echo "" ;;  # ddp, fsdp, and scripts this sweep does not know: no flags of their own
    esac
}

# run_one LABEL LOG FAILURE_FIELDS COMMAND...: one run, its outcome on one line; a failure
# is also written to failures.jsonl, with FAILURE_FIELDS (JSON) beside its error.
run_one() {
    local label=$1 log=$2 fields=$3 start status seconds error
    shift 3
    printf '%s ... ' "$label"
    start=$(date +%s)
    "$@" > "$log" 2>&1
    status=$? seconds=$(( $(date +%s) - start ))
    if [ $status = 0 ]; then
        echo "$seconds s"
    else
        error=$(grep -m1 -E '^error: |Error: |Error\b' "$log" || tail -n 1 "$log")
        echo "FAILED after $seconds s: ${error:0:160} (log: $log)"
        python3 -c 'import json, sys; f, e, l = sys.argv[1:]; print(json.dumps({**json.loads(f), "error": e, "log": l}))' \
            "$fields" "$error" "$log" >> "$failures"
    fi
}

total=$(( ${#strategy_list[@]} * (${#gpu_list[@]} + ${#sim_list[@]}) )) i=0
for strategy in "${strategy_list[@]}"; do
    for n in "${gpu_list[@]}"; do
        i=$((i + 1))
        args=$(plan "$strategy" "$n") batch=$(batch_for "$strategy" "$n")
        case $args in skip:*) echo "[$i/$total] $strategy x$n ... skipped (${args#skip: })"; continue ;; esac
        profile_args=()
        [ "$profile" = 0 ] || profile_args=(--profile "$out/profiles/${strategy}_x$n")
        # The strategy's own flags are shown, so what a row ran can be checked against its record.
        # shellcheck disable=SC2086  # $args holds several flags
        run_one "[$i/$total] $strategy x$n${args:+ $args}" "$out/logs/${strategy}_x$n.log" \
            "{\"strategy\": \"$strategy\", \"world_size\": $n, \"global_batch_size\": $batch}" \
            torchrun --standalone --nproc_per_node="$n" "${strategy}_train.py" --model "$model" --steps "$steps" \
            --global-batch-size "$batch" --seq-len "$seq_len" "${device_args[@]}" "${compile_args[@]}" --count-comm --results "$results" "${profile_args[@]}" $args
        [ -n "$float8" ] || continue
        # shellcheck disable=SC2086
        run_one "[$i/$total] $strategy x$n --float8 $float8${float8_args[*]:+ ${float8_args[*]}}${args:+ $args}" \
            "$out/logs/${strategy}_x${n}_float8.log" \
            "{\"strategy\": \"$strategy\", \"world_size\": $n, \"global_batch_size\": $batch, \"float8\": \"$float8\"}" \
            torchrun --standalone --nproc_per_node="$n" "${strategy}_train.py" --model "$model" --steps "$steps" \
            --global-batch-size "$batch" --seq-len "$seq_len" "${device_args[@]}" "${float8_args[@]}" --float8 "$float8" --count-comm --results "$results" $args
    done
    # Predicted rows: each distinct rank of an n-rank run, alone on this device (a plain
    # python process: --simulate makes its fake world of n itself).
    for n in "${sim_list[@]}"; do
        i=$((i + 1))
        args=$(max=$n plan "$strategy" "$n") batch=$(batch_for "$strategy" "$n")
        case $args in skip:*) echo "[$i/$total] $strategy x$n simulated ... skipped (${args#skip: })"; continue ;; esac
        for rank in ${roles["$strategy $n"]}; do
            # shellcheck disable=SC2086
            run_one "[$i/$total] $strategy x$n simulated rank $rank${args:+ $args}" "$out/logs/${strategy}_x${n}_rank$rank.log" \
                "{\"strategy\": \"$strategy\", \"world_size\": $n, \"global_batch_size\": $batch, \"simulated\": true, \"simulated_rank\": $rank}" \
                python3 "${strategy}_train.py" --simulate "$n" --simulate-rank "$rank" --model "$model" --steps "$steps" \
                --global-batch-size "$batch" --seq-len "$seq_len" "${device_args[@]}" "${compile_args[@]}" --results "$out/simulated.jsonl" $args
        done
    done
done

# The table, and REPORT.md with its pictures.
python3 sweep_report.py "$out" "${link_args[@]}"
