#!/usr/bin/env bash
# Which strategy wins: every strategy over the GPU counts this machine can serve (and, with
# --simulate, counts it cannot, predicted from this one), each at a count on the same job,
# the same global batch, at its best settings; then the table against the 1-GPU baseline
# (ddp_train.py at world size 1), the ranking at each count, and the report (REPORT.md
# and its pictures, sweep_report.py), all in the sweep's folder.
#
#   bash run_all.sh                      # every strategy on 1, 2, 4, ... GPUs
#   bash run_all.sh --strategies ddp,pipeline --gpus 1,4 --model 350m
#   bash run_all.sh --simulate 2,4,8     # predict 2, 4, 8 GPUs from this one (README, 'Predicting')
#   bash run_all.sh --model 2.5b-long --seq-len 65536 --strategies context_parallel --global-batch-size 1 --strong --gpus 1 --simulate 2,4,8
#                                        # which long sequences fit at 2, 4, 8 GPUs, from each simulated rank's memory
#
# Options (flags only: environment variables such as MODEL or OUT, which other tools
# set for their own purposes, are ignored; each flag at most once):
#   --model M              a model preset of common.py (default: 2.5b on GPUs of 60 GiB or more, else 350m; tiny on CPU)
#   --steps N              optimizer steps per run, at least 5 (default: 20, 10 on CPU; the first 3 and the counted last are not timed)
#   --strategies a,b       which *_train.py scripts to run (default: ddp,model_parallel,pipeline,hybrid,fsdp,tensor_parallel,context_parallel)
#   --gpus 1,2,4           GPU counts to measure, at most the machine's (default: 1, 2, 4, ... up to what it has; 1,2 processes on CPU)
#   --global-batch-size G  samples per step at 1 GPU; at N GPUs every strategy trains G x N (default: 8)
#   --strong               strong scaling: every strategy trains G at every count
#   --seq-len T            tokens per sample in every run (default: the preset's context length)
#   --out DIR              results folder, new or empty (default: a new results/<date-time>-<random>)
#   --simulate 2,4,8       also predict these GPU counts, each distinct rank run alone here on a fake process
#                          group (default: the measured counts above 1, none on a one-GPU machine; none for none)
#   --intra-gbps X         with --simulate: bus bandwidth per GPU inside a node (default: LINK_GBPS in sweep/predict.py)
#   --inter-gbps Y         with --simulate: bus bandwidth per GPU across nodes (default: LINK_GBPS in sweep/predict.py)
#   --gpus-per-node K      with --simulate: GPUs a node holds (default: 8)
#   --profile              trace 3 steps of every measured run with torch.profiler (left out of its timing), into OUT/profiles/<run>/
#                          (one Chrome trace and op table per rank; REPORT.md links them); needs --steps of at least 10
#   --eager                on GPUs, run every row eager (there every row, the baseline included, compiles by default)
#   --compile              on the CPU, torch.compile every run's blocks (there every row runs eager by default)
#   --float8 MODE          GPUs only: also run every measured row with --float8 MODE (tensorwise or rowwise), as a
#                          row of its own with the same settings; compiled, even with --eager (eager float8 is slower than bf16)
#   --cpu                  force the CPU fallback even where there is a GPU
#
# One job per count: at N GPUs every strategy trains the same global batch, G x N (the
# data-parallel rows' weak scaling), or G with --strong. Each strategy at its best for
# that job: pipelines take enough micro-batches that the schedule's bubble is small;
# where the best settings are not obvious (interleaved 1F1B or 1F1B; tensor parallel with
# or without sequence parallelism) each is tried as simulated ranks at that count and the
# fastest predicted is the one measured; a run out of memory runs again with
# --activation-checkpointing. Each row says its batch and flags. With no GPU, the sweep
# runs the tiny model in 1-2 CPU processes on gloo, to show the whole flow in a few
# minutes. Every run gets OMP_NUM_THREADS=1, whatever the environment says, so that all
# rows compare alike. Ctrl-C (or SIGTERM, SIGHUP, SIGQUIT, a reader of its output that
# left) ends the sweep and the running row's processes within seconds, and writes the
# table of what finished. Exit status: 0; 1 where a row
# failed (other than running out of memory: that is a row's answer) or the report left
# a damaged line out; 2 for a refused option; 128 + the signal's number when interrupted.
set -uo pipefail
caller=$PWD
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
# repeated LIST: the first item a comma-separated list names twice, if any.
repeated() {
    local -A seen=()
    local item items
    IFS=, read -r -a items <<< "$1"
    for item in "${items[@]}"; do
        [ -n "$item" ] || continue  # an empty one is refused as such
        [ -z "${seen[$item]+x}" ] || { echo "$item"; return; }
        seen[$item]=1
    done
}
# Below 10^9: every figure stays far inside bash's arithmetic.
positive='^[1-9][0-9]{0,8}$'
counts='^[1-9][0-9]{0,8}(,[1-9][0-9]{0,8})*$'
# Until the first run starts, a signal ends the sweep at once: nothing is running yet.
trap 'echo "run_all.sh: interrupted before any run" >&2; exit 130' INT
trap 'echo "run_all.sh: terminated before any run" >&2; exit 143' TERM
trap 'echo "run_all.sh: hung up before any run" >&2; exit 129' HUP
trap 'echo "run_all.sh: quit before any run" >&2; exit 131' QUIT

# Lower-case names throughout: every setting starts here or from a flag, never from the environment.
default_simulate='' model='' steps='' seq_len='' strategies='' gpus='' global_batch=8 out='' strong=false cpu=0 simulate='' link_args=() compile=''
float8='' profile=0 seen=' '
while [ $# -gt 0 ]; do
    case "$1" in
        --model|--steps|--seq-len|--strategies|--gpus|--global-batch-size|--out|--simulate|--intra-gbps|--inter-gbps|--gpus-per-node|--float8)
            [ $# -ge 2 ] && [ -n "$2" ] && [[ $2 != --* ]] || refuse "$1 needs a value (see --help)" ;;
    esac
    case "$1" in
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        --*) [[ $seen != *" $1 "* ]] || refuse "$1 is given twice: give it once"; seen+="$1 " ;;
    esac
    case "$1" in
        --model) model=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --seq-len) seq_len=$2; shift 2 ;;
        --strategies) strategies=$2; shift 2 ;;
        --gpus) gpus=$2; shift 2 ;;
        --global-batch-size) global_batch=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --strong) strong=true; shift ;;
        --cpu) cpu=1; shift ;;
        --profile) profile=1; shift ;;
        --compile|--eager) [ -z "$compile" ] || refuse "--compile and --eager contradict each other: give one"; compile=${1#--}; shift ;;
        --float8) one_of "$2" tensorwise rowwise || refuse "--float8 $2: expected tensorwise or rowwise"; float8=$2; shift 2 ;;
        --simulate) simulate=$2; shift 2 ;;
        --intra-gbps|--inter-gbps)
            [[ $2 =~ ^[0-9]{1,6}(\.[0-9]+)?$|^\.[0-9]+$ ]] && [[ $2 =~ [1-9] ]] || refuse "$1 $2: expected a positive number of GB/s, e.g. 460"
            link_args+=("$1" "$2"); shift 2 ;;
        --gpus-per-node) [[ $2 =~ $positive ]] || refuse "$1 $2: expected a positive whole number"; link_args+=("$1" "$2"); shift 2 ;;
        *) refuse "unknown option $1 (see --help)" ;;
    esac
done

[ -z "$steps" ] || [[ $steps =~ $positive ]] || refuse "--steps $steps: expected a positive whole number"
# Throughput skips 3 warm-up steps and the counted last (it runs under the byte counter),
# so 5 steps leave one timed; --profile's 5 more (its warm-up, 3 traced, its export) need 10.
[ -z "$steps" ] || [ "$steps" -ge 5 ] || refuse "--steps $steps: throughput leaves out 3 warm-up steps and the counted last, so a run needs --steps of at least 5"
[ "$profile" = 0 ] || [ -z "$steps" ] || [ "$steps" -ge 10 ] || refuse "--profile --steps $steps: the profiled steps are not timed, so --profile needs --steps of at least 10"
[ -z "$seq_len" ] || [[ $seq_len =~ $positive ]] || refuse "--seq-len $seq_len: expected a positive whole number"
[[ $global_batch =~ $positive ]] || refuse "--global-batch-size $global_batch: expected a positive whole number"
[ -z "$gpus" ] || [[ $gpus =~ $counts ]] || refuse "--gpus $gpus: expected positive counts separated by commas, e.g. 1,2,4"
[ -z "$simulate" ] || [ "$simulate" = none ] || { [[ $simulate =~ $counts ]] && [[ ,$simulate, != *,1,* ]]; } \
    || refuse "--simulate $simulate: expected counts of 2 or more separated by commas, e.g. 2,4,8, or none"
for list in "--gpus $gpus" "--simulate $simulate" "--strategies $strategies"; do
    twice=$(repeated "${list#* }")
    [ -z "$twice" ] || refuse "$list: $twice is named twice"
done
IFS=, read -r -a items <<< "${simulate/none/}"
for item in "${items[@]}"; do [ "$item" -le 4096 ] || refuse "--simulate $simulate: the scripts simulate at most 4096 ranks"; done
out_given=$out
[ -z "$out" ] || [[ $out = /* ]] || out=$caller/$out  # named from where the sweep was started, not from this folder
if [ -n "$out" ] && [ -e "$out" ]; then
    [ -d "$out" ] || refuse "--out $out_given: exists and is not a folder; name a new or empty one"
    [ -z "$(ls -A "$out" 2>/dev/null)" ] || refuse "--out $out_given: holds files already (another sweep's?); name a new or empty one"
fi
# The strategies this folder holds, one *_train.py each.
scripts=(*_train.py)
scripts=("${scripts[@]%_train.py}")
if [ -z "$strategies" ]; then
    for strategy in ddp model_parallel pipeline hybrid fsdp tensor_parallel context_parallel; do
        [ -f "${strategy}_train.py" ] && strategies+=${strategies:+,}$strategy
    done
fi
IFS=, read -r -a strategy_list <<< "$strategies"
[[ ,$strategies, != *,,* ]] || refuse "--strategies $strategies: an empty name between commas"
for strategy in "${strategy_list[@]}"; do
    one_of "$strategy" "${scripts[@]}" || refuse "--strategies $strategies: no ${strategy}_train.py here; accepted: $(IFS=,; echo "${scripts[*]}")"
done

# What the machine has, and the model presets common.py defines.
probe=$(python3 -c "
import torch, common
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print('machine', torch.cuda.device_count(), p.total_memory // 2**30, p.name.replace(' ', '_'))
else:
    print('machine', 0, 0, 'none')
print('contexts', *(f'{name}:{cfg.max_seq_len}' for name, cfg in common.PRESETS.items()))" 2>&1) \
    || refuse "python3 cannot import torch and common.py: ${probe##*$'\n'}"
read -r _ n_gpus gpu_gib gpu_name <<< "$(grep '^machine ' <<< "$probe")"
read -r _ contexts <<< "$(grep '^contexts ' <<< "$probe")"
read -r -a presets <<< "$(sed 's/:[0-9]*//g' <<< "$contexts")"
[ -z "$model" ] || one_of "$model" "${presets[@]}" || refuse "--model $model: not a preset of common.py; accepted: $(IFS=,; echo "${presets[*]}")"

if [ "$cpu" = 1 ] || [ "$n_gpus" = 0 ]; then
    [ -z "$float8" ] || refuse "--float8 $float8 needs a GPU (Hopper or newer): on the CPU torchao emulates float8, minutes per run that say nothing about its speed"
    device=cpu device_args=(--device cpu --num-workers 0) compile_args=() float8_args=()
    [ "$compile" != compile ] || compile_args=(--compile)
    model=${model:-tiny} steps=${steps:-10} gpus=${gpus:-1,2} max=2 max_label="2 processes (the CPU fallback)"
    unit=processes
    banner="No GPU in use: CPU fallback, model $model in 1-2 gloo processes, $steps steps per run, $([ ${#compile_args[@]} = 0 ] && echo eager || echo compiled). The numbers show the flow, not GPU performance."
else
    [ -n "$model" ] || { [ "$gpu_gib" -ge 60 ] && model=2.5b || model=350m; }
    device=cuda device_args=(--device cuda)
    compile_args=(--compile) float8_args=()
    [ "$compile" != eager ] || compile_args=() float8_args=(--compile)
    steps=${steps:-20} max=$n_gpus max_label="$n_gpus GPU" unit=GPUs
    [ "$n_gpus" = 1 ] || max_label+=s
    if [ -z "$gpus" ]; then
        gpus=1 n=2
        while [ $n -le "$n_gpus" ]; do gpus="$gpus,$n"; n=$((n * 2)); done
        case ",$gpus," in *",$n_gpus,"*) ;; *) gpus="$gpus,$n_gpus" ;; esac
    fi
    banner="$n_gpus x ${gpu_name//_/ } ($gpu_gib GiB): model $model, $steps steps per run, $([ ${#compile_args[@]} = 0 ] && echo eager || echo compiled)"
fi
IFS=, read -r -a gpu_list <<< "$gpus"
for n in "${gpu_list[@]}"; do
    [ "$n" -le "$max" ] || refuse "--gpus $gpus: this machine runs at most $max_label; predict $n with --simulate $n"
    # Where several GPUs (or CPU processes) measure, predict the same counts: every run then
    # checks the model, and the settings measured are the fastest predicted.
    [ -n "$simulate" ] || { [ "$device" = cuda ] && [ "$n_gpus" = 1 ]; } || [ "$n" = 1 ] || default_simulate+=${default_simulate:+,}$n
done
simulate=${simulate:-${default_simulate:-}}
[ "$simulate" != none ] || simulate=''
[ -n "$simulate" ] || [ ${#link_args[@]} = 0 ] || refuse "${link_args[0]} models the wire of predicted rows: it needs --simulate"
IFS=, read -r -a sim_list <<< "$simulate"
max_seq_len=$(tr ' ' '\n' <<< "$contexts" | sed -n "s/^$model://p")
[ -z "$seq_len" ] || [ "$seq_len" -le "$max_seq_len" ] || refuse "--seq-len $seq_len: exceeds the $model preset's context of $max_seq_len (2.5b-long holds 131072)"
seq_len=${seq_len:-$max_seq_len}
if [ "$strong" = true ]; then job="global batch $global_batch at every count"; else job="global batch $global_batch x the count"; fi

# The plan: every run of the sweep, with its settings, or why it is skipped (sweep/plan.py).
json_list() { local IFS=,; echo "[$*]"; }
quoted=("${strategy_list[@]/#/\"}")
spec="{\"model\": \"$model\", \"strategies\": $(json_list "${quoted[@]/%/\"}"), \"gpus\": $(json_list "${gpu_list[@]}"),
       \"simulate\": $(json_list "${sim_list[@]}"), \"batch\": $global_batch, \"strong\": $strong, \"device\": \"$device\",
       \"steps\": $steps, \"seq_len\": $seq_len, \"float8\": $([ -n "$float8" ] && echo "\"$float8\"" || echo null)}"
if ! planned=$(python3 sweep_report.py --plan "$spec" 2>&1); then
    last=${planned##*$'\n'}
    [[ $last = "sweep_report.py: "* ]] && refuse "${last#sweep_report.py: }" || refuse "python3 sweep_report.py cannot plan the sweep: $last"
fi
mapfile -t plan < <(grep -E $'^(run|skip)\t' <<< "$planned")
! grep -qE $'^run\t[^\t]*\t[^\t]*\t(measured|float8)' <<< "$planned" || command -v torchrun > /dev/null \
    || refuse "torchrun is not on PATH: it comes with torch (pip install torch), in the environment python3 runs"

# A folder of its own for every sweep: mktemp makes a new one atomically, and an explicit
# --out is claimed by creating its logs/, which fails if another sweep got there first.
if [ -z "$out" ]; then
    error=$(mkdir -p results 2>&1) || refuse "cannot make results/ in $PWD (${error##*: }): name a folder with --out DIR"
    out=$(mktemp -d "results/$(date +%Y%m%d-%H%M%S)-XXXXXX" 2>&1) || refuse "cannot make a folder in results/ (${out##*: }): name one with --out DIR"
fi
out_given=${out_given:-$out}
error=$(mkdir -p -- "$out" 2>&1) || refuse "--out $out_given cannot be made (${error##*: }): name a new or empty folder"
if ! error=$(mkdir -- "$out/logs" 2>&1); then
    [ ! -e "$out/logs" ] || refuse "--out $out_given: another sweep took it first; name a new or empty folder"
    refuse "--out $out_given: cannot write into it (${error##*: })"
fi
results="$out/results.jsonl" failures="$out/failures.jsonl"
: > "$results"; : > "$failures"

# torchrun sets OMP_NUM_THREADS=1 only when it starts more than one process, so without
# this the 1-GPU rows would run with every core and the others with one thread each.
# One thread per process for every row: on CPU, n processes then use n cores.
export OMP_NUM_THREADS=1

# The runner of one run: the command in a session of its own (Ctrl-C reaches the sweep, not
# its runs), its output into LOG, a line every minute it runs. It adopts every orphan
# of the run (PR_SET_CHILD_SUBREAPER: torchrun starts each rank in a session of its own,
# out of reach of a process-group signal), so on SIGINT, SIGTERM or SIGHUP it ends them
# all, SIGINT first (a rank then exits as interrupted, writing no results line), SIGKILL
# after 3 s, and after a run it ends any rank that outlived its launcher. The sweep
# killed outright (SIGKILL) reaches it as SIGTERM (PR_SET_PDEATHSIG).
# Exit status: the command's, or 128 + the signal's number.
read -r -d '' runner <<'EOF'
import ctypes, os, select, signal, stat, subprocess, sys, time

sweep, log, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
stop = []
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, lambda signum, frame: stop.append(signum))
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != sweep:  # the sweep died before that
    stop.append(signal.SIGTERM)


def descendants():
    """{pid: state} of every process under this one."""
    seen = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            seen[int(entry)] = (int(fields[1]), fields[0])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = {}, {os.getpid()}
    while frontier:
        frontier = {pid for pid, (parent, _) in seen.items() if parent in frontier and pid not in found}
        found.update({pid: seen[pid][1] for pid in frontier})
    return found


def live(child):
    """The live descendants, the dead ones reaped (the run itself by Popen)."""
    child.poll()
    alive = []
    for pid, state in descendants().items():
        if state != "Z":
            alive.append(pid)
        elif pid != child.pid:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
    return alive


def reader_left():
    """Whether the sweep's output is a pipe whose reader has gone (`| head`)."""
    if not stat.S_ISFIFO(os.fstat(1).st_mode):
        return False
    poll = select.poll()
    poll.register(1, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def last_step(path):
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 8192))
            lines = [l.strip() for l in f.read().decode("utf-8", "replace").splitlines() if " step " in f" {l}"]
    except OSError:
        return ""
    return lines[-1][:110] if lines else ""


if stop:
    sys.exit(128 + stop[0])
try:
    with open(log, "w") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
except OSError as e:  # a log that cannot be written, a command that cannot start: the sweep's failure line says which
    print(f"error: cannot run {argv[0]} into {log}: {e.strerror or e}", end=" ", flush=True)
    sys.exit(127)
start = time.monotonic()
beat = start + 60
while child.poll() is None and not stop:
    try:
        child.wait(timeout=0.5)  # returns as the run ends; a signal is seen within the half second
    except subprocess.TimeoutExpired:
        pass
    if reader_left():
        stop.append(signal.SIGPIPE)
    elif time.monotonic() >= beat:
        beat += 60
        step = last_step(log)
        print(f"\n    still running after {time.monotonic() - start:.0f} s" + (f": {step}" if step else ""), end="", flush=True)
code = 128 + stop[0] if stop else child.returncode if child.returncode >= 0 else 128 - child.returncode
for signum, grace in ((signal.SIGINT, 3), (signal.SIGKILL, 5)) if stop else ((signal.SIGKILL, 5),):
    for pid in live(child):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while live(child) and time.monotonic() < deadline:
        time.sleep(0.05)
if beat > start + 60 and not reader_left():
    print("\n   ", end="", flush=True)
sys.exit(code)
EOF

# A signal from now on: the running row is ended (its runner ends its processes), the
# sweep stops after it and reports what finished.
# A reader that left (`| head`) ends it the same way; nothing more is written to it.
interrupted='' row_pid=''
on_signal() {
    interrupted=${interrupted:-$1}
    [ -z "$row_pid" ] || kill -TERM "$row_pid" 2>/dev/null
    [ "$1" != SIGPIPE ] || exec > /dev/null
}
trap 'on_signal SIGINT' INT
trap 'on_signal SIGTERM' TERM
trap 'on_signal SIGHUP' HUP
trap 'on_signal SIGQUIT' QUIT
trap 'on_signal SIGPIPE' PIPE

finished=() failed_rows=0 outcome=''
# run_one LABEL NAME LOG FAILURE_FIELDS COMMAND...: one run, its outcome on one line and in
# $outcome (ok, oom, failed or interrupted); a failure is also written to failures.jsonl,
# with FAILURE_FIELDS (JSON) beside its error; NAME is what the list of finished runs calls it.
run_one() {
    local label=$1 name=$2 log=$3 fields=$4 start status seconds error
    shift 4
    [ -z "$interrupted" ] || { outcome=interrupted; return; }
    printf '%s ... ' "$label" 2> /dev/null  # a reader that left: SIGPIPE says so, once
    start=$(date +%s)
    python3 -c "$runner" "$$" "$log" "$@" &
    row_pid=$!
    [ -z "$interrupted" ] || kill -TERM "$row_pid" 2>/dev/null  # a signal between its start and row_pid
    while :; do
        wait "$row_pid"
        status=$?
        [ $status -gt 128 ] && kill -0 "$row_pid" 2>/dev/null || break  # wait returned for a signal: the runner still ends the run
    done
    row_pid='' seconds=$(( $(date +%s) - start ))
    [ "$status" != 141 ] || on_signal SIGPIPE  # the runner saw the reader of this output leave
    if [ -n "$interrupted" ]; then
        echo "interrupted after $seconds s"
        outcome=interrupted
    elif [ $status = 0 ]; then
        echo "$seconds s"
        outcome=ok
        finished+=("$name")
    else
        error=$(grep -m1 -E '^error: |Error: |Error\b' "$log" || tail -n 1 "$log")
        echo "FAILED after $seconds s: ${error:0:160} (log: $log)"
        python3 -c 'import json, sys; f, e, l = sys.argv[1:]; print(json.dumps({**json.loads(f), "error": e, "log": l}))' \
            "$fields" "$error" "$log" >> "$failures"
        case $error in *"out of memory"*) outcome=oom ;; *) outcome=failed ;; esac
    fi
}

# run_row MODE RANKS FLAGS: one row of the plan, every rank of it (a simulated row's ranks,
# else one run); a run out of memory runs again, every rank, with --activation-checkpointing.
run_row() {
    local mode=$1 ranks=$2 flags=$3 rank attempt label log fields extra=()
    for attempt in 1 2; do
        for rank in $ranks; do
            label="[$i/$total] $script x$n" log="$out/logs/$(printf %03d "$i")-${script}_x$n" fields="\"strategy\": \"$script\", \"world_size\": $n, \"global_batch_size\": $batch, \"flags\": \"$flags\""
            case $mode in
                simulated) label+=" simulated rank $rank" log+="_rank$rank" fields+=", \"simulated\": true, \"simulated_rank\": $rank" ;;
                float8) label+=" float8" log+="_float8" fields+=", \"float8\": \"$float8\"" extra=(--float8 "$float8" "${float8_args[@]}") ;;
            esac
            # The row's own flags are shown, so what it ran can be checked against its record.
            # shellcheck disable=SC2086  # $flags holds several flags
            set -- ${flags} "${extra[@]}"
            label+=", global batch $batch${1:+: $*}${note:+ ($note)}"
            [ "$attempt" = 1 ] || log+="_checkpointed"
            # A measured run counts its last step's collectives (--count-comm; that step is not
            # timed) for the report's bytes and its check against the prediction; a simulated rank counts them anyway.
            case $mode in
                simulated) run_one "$label" "$script x$n simulated rank $rank" "$log.log" "{$fields}" \
                    python3 "${script}_train.py" --simulate "$n" --simulate-rank "$rank" --model "$model" --steps "$steps" \
                    --global-batch-size "$batch" --seq-len "$seq_len" "${device_args[@]}" "${compile_args[@]}" --results "$out/simulated.jsonl" "$@" ;;
                measured) run_one "$label" "$script x$n" "$log.log" "{$fields}" \
                    torchrun --standalone --nproc_per_node="$n" "${script}_train.py" --model "$model" --steps "$steps" \
                    --global-batch-size "$batch" --seq-len "$seq_len" "${device_args[@]}" "${compile_args[@]}" --count-comm --results "$results" \
                    "${profile_args[@]}" "$@" ;;
                float8) run_one "$label" "$script x$n float8" "$log.log" "{$fields}" \
                    torchrun --standalone --nproc_per_node="$n" "${script}_train.py" --model "$model" --steps "$steps" \
                    --global-batch-size "$batch" --seq-len "$seq_len" "${device_args[@]}" "${compile_args[@]}" --count-comm --results "$results" "$@" ;;
            esac
            [ "$outcome" = ok ] || break
        done
        [ "$outcome" = oom ] && [[ $flags != *--activation-checkpointing* ]] || break
        flags+="${flags:+ }--activation-checkpointing" note=''
        echo "    out of memory: the row again with --activation-checkpointing"
    done
    [ "$outcome" = ok ] || [ "$outcome" = oom ] || [ "$outcome" = interrupted ] || failed_rows=$((failed_rows + 1))
    row_flags=$flags
}

# Rows (the plan's lines) and runs (a simulated row runs each of its ranks).
total=${#plan[@]} rows=0 runs=0
for line in "${plan[@]}"; do
    [[ $line = run* ]] || continue
    IFS=$'\t' read -r -a fields <<< "$line"
    read -r -a ranks <<< "${fields[5]}"
    rows=$((rows + 1)) runs=$((runs + ${#ranks[@]}))
done
echo "$banner"
echo "One job per count: every strategy at N $unit trains $job (--global-batch-size, --strong); $rows rows to run ($runs runs), $((total - rows)) skipped."
declare -A chosen=()
i=0
for line in "${plan[@]}"; do
    i=$((i + 1))
    IFS=$'\t' read -r -a fields <<< "$line"
    script=${fields[1]} n=${fields[2]} mode=${fields[3]}
    if [ "${fields[0]}" = skip ]; then
        echo "[$i/$total] $script x$n$(case $mode in simulated) echo " simulated" ;; float8) echo " float8" ;; esac) ... skipped (${fields[4]})"
        continue
    fi
    batch=${fields[4]} ranks=${fields[5]} settings=${fields[6]} choose=${fields[7]} note=${fields[8]}
    IFS='|' read -r -a tried <<< "$settings"
    for k in "${!tried[@]}"; do [ "${tried[$k]}" != - ] || tried[$k]=''; done  # "-": no flags
    [ "$note" != - ] || note=''
    flags=${tried[0]}
    if [ "$mode" = measured ] && [ ${#tried[@]} -gt 1 ]; then
        if [ "$choose" = 1 ] && fastest=$(python3 sweep_report.py --best "$out" "$script" "$n" "$batch" "${link_args[@]}" 2>/dev/null); then
            [ "$fastest" = - ] && flags='' || flags=$fastest
            note="${note:+$note; }the fastest of ${#tried[@]} settings tried"
        else
            note="${note:+$note; }$([ "$choose" = 1 ] && echo "none of its ${#tried[@]} settings was predicted" || echo "$n not simulated"): the first of ${#tried[@]}"
        fi
    fi
    [ "$mode" != float8 ] || flags=${chosen["$script $n"]-$flags}
    profile_args=()
    [ "$profile" = 0 ] || [ "$mode" != measured ] || profile_args=(--profile "$out/profiles/${script}_x$n")
    [ "$ranks" != - ] || ranks=0
    run_row "$mode" "$ranks" "$flags"
    [ "$mode" != measured ] || chosen["$script $n"]=$row_flags
    [ -z "$interrupted" ] || break
done

# The table, and REPORT.md with its pictures, of what finished.
if [ -n "$interrupted" ]; then
    if [ ${#finished[@]} = 0 ]; then
        done_runs="none of the $runs runs finished"
    else
        done_runs="${#finished[@]} of $runs runs finished ($(printf '%s, ' "${finished[@]}" | sed 's/, $//')); the table below is theirs"
    fi
    echo "run_all.sh: $interrupted during [$i/$total]: $done_runs" >&2
fi
status=0
if [ -s "$results" ] || [ -s "$failures" ] || [ -s "$out/simulated.jsonl" ]; then
    trap '' INT  # the table of what finished is what an interruption keeps: a few seconds, not cut short
    python3 sweep_report.py "$out" "${link_args[@]}"
    status=$?
fi
if [ "$failed_rows" != 0 ]; then
    echo "run_all.sh: $failed_rows of $rows rows failed (their lines above say why)" >&2
    status=1
fi
case $interrupted in SIGINT) status=130 ;; SIGTERM) status=143 ;; SIGHUP) status=129 ;; SIGQUIT) status=131 ;; SIGPIPE) status=141 ;; esac
if [ -z "$interrupted" ] && [ "$device" = cuda ] && [ "$n_gpus" = 1 ] && [ ${#sim_list[@]} = 0 ]; then
    echo "One GPU here: bash run_all.sh --simulate 2,4,8 predicts 2, 4 and 8 GPUs from it, each rank of those runs measured on this one (README, 'Predicting')."
fi
exit "$status"
