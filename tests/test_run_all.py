"""run_all.sh. Against stub scripts (tests/stub_scripts: they record their argv and write
a made-up results line) on a machine described to it (a stand-in torch): every row runs
exactly the batch and flags it announces, every strategy at a count on the same batch,
the settings measured the fastest tried; every bad option refused in one line before
any run; a signal ends the sweep, its running row's ranks included, and the table of
what finished is written. Then one CPU sweep of the real scripts end to end."""

import ast
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import common
from sweep.lines import STRATEGY_OF_SCRIPT
from sweep.pictures import PICTURES
from sweep.predict import link_bandwidth
from sweep.settings import candidate_predictions, flags_of, predicted_rate
from harness import ROOT

STUBS = Path(__file__).parent / "stub_scripts"
STRATEGIES = ["ddp", "model_parallel", "pipeline", "hybrid", "fsdp", "tensor_parallel", "context_parallel"]
# The flags every run of a sweep gets, and how many values each takes; the rest of a run's argv is its row's own.
COMMON_FLAGS = {"--model": 1, "--steps": 1, "--global-batch-size": 1, "--seq-len": 1, "--device": 1, "--num-workers": 1, "--results": 1,
                "--profile": 1, "--simulate": 1, "--simulate-rank": 1, "--compile": 0, "--count-comm": 0}
ANNOUNCED = re.compile(r"^\[(\d+)/(\d+)\] (\S+) x(\d+)( simulated rank \d+| float8)?, global batch (\d+)(?:: ([^(]*?))?(?: \(([^)]*)\))? \.\.\. (.*)$")


# What sweep_report.py (with sweep/) and run_all.sh read of each module, which the stand-in torch cannot import.
TORCHLESS = {"common": {"ModelConfig", "PRESETS", "flops_per_token", "number", "positive", "positive_float"},
             "pipeline_train": {"stages_of_rank", "theoretical_bubble_pct", "ZERO_BUBBLE"}}


def torchless(module):
    """The parts of a module that sweep_report and run_all.sh read, without torch (the
    stand-in torch has nothing else): taken from the module's own source."""
    source = (ROOT / f"{module}.py").read_text()
    wanted = TORCHLESS[module]
    lines, parts = source.splitlines(), ["import argparse\nimport math\nfrom dataclasses import dataclass, replace\n"]
    for node in ast.parse(source).body:
        targets = getattr(node, "targets", [])
        names = {getattr(node, "name", None)} | {getattr(t, "id", None) for t in targets} | {getattr(getattr(t, "value", None), "id", None) for t in targets}
        if names & wanted:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            parts.append("\n".join(lines[start - 1:node.end_lineno]))
    return "\n\n".join(parts) + "\n"


def make_stub_sweep(folder):
    """A copy of the sweep in folder whose scripts are stubs, its torchrun one process, its torch a stand-in."""
    folder.mkdir(parents=True)
    for name in ("run_all.sh", "sweep_report.py"):
        shutil.copy(ROOT / name, folder)
    shutil.copytree(ROOT / "sweep", folder / "sweep")
    shutil.copytree(STUBS / "torch", folder / "torch")
    # No pictures: drawing them is most of a stub sweep's time, and the real sweep's test
    # (test_cpu_sweep_reports_what_the_runs_measured) checks them.
    (folder / "matplotlib").mkdir()
    (folder / "matplotlib" / "__init__.py").write_text('raise ImportError("the stub sweep draws no pictures")\n')
    (folder / "common.py").write_text(torchless("common"))
    stub = (STUBS / "stub_train.py").read_text()
    for script in STRATEGIES:  # pipeline_train.py also holds the helpers sweep/ imports from it
        (folder / f"{script}_train.py").write_text(torchless(f"{script}_train") + "\n\n" + stub if f"{script}_train" in TORCHLESS else stub)
    (folder / "bin").mkdir()
    shutil.copy(STUBS / "torchrun", folder / "bin" / "torchrun")
    (folder / "bin" / "torchrun").chmod(stat.S_IRWXU)
    return folder


@pytest.fixture
def stub_sweep(tmp_path):
    return make_stub_sweep(tmp_path / "sweep")


def stub_path(folder):
    """PATH with the stub's torchrun first, then this interpreter's own folder: run through a
    version manager's shim (pyenv's), python3 would put the real torchrun ahead of the stub
    for everything it starts, and each row would launch torch's (1.5 s of imports)."""
    return f"{folder / 'bin'}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}"


def run_sweep(folder, *args, gpus=(0, 0, "none"), knobs=None, stub_torchrun=True, env=None, timeout=120):
    """bash run_all.sh ARGS in a stub sweep on a machine of gpus = (count, GiB, name).
    Returns (CompletedProcess, the runs: [(announced fields, argv the stub got)])."""
    (folder / "machine.json").write_text(json.dumps(list(gpus)))
    (folder / "stub.json").write_text(json.dumps(knobs or {}))
    (folder / "argv.jsonl").unlink(missing_ok=True)
    path = stub_path(folder) if stub_torchrun else os.environ["PATH"]
    proc = subprocess.run(["bash", "run_all.sh", *args], cwd=folder, env={**os.environ, "PATH": path, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    return proc, runs_of(folder, proc.stdout)


def runs_of(folder, stdout):
    """Each run's announcement paired with the argv its script got (they run one after another)."""
    announced = [m.groups() for m in map(ANNOUNCED.match, stdout.splitlines()) if m and not m[9].startswith("skipped")]
    argvs = [json.loads(line) for line in open(folder / "argv.jsonl")] if (folder / "argv.jsonl").exists() else []
    assert len(announced) == len(argvs), (stdout, argvs)
    return list(zip(announced, argvs))


def own_flags(argv):
    """What a run's argv holds beyond the flags every run of the sweep gets."""
    own, args = [], list(argv)
    while args:
        flag = args.pop(0)
        if flag in COMMON_FLAGS:
            del args[:COMMON_FLAGS[flag]]
        else:
            own.append(flag)
    return " ".join(own)


def value(argv, flag):
    return argv[argv.index(flag) + 1]


def fewest_micro_batches(batch, pp, stages_per_rank):
    """The rule a pipeline's micro-batches follow: the fewest that split its batch, one at
    least for each of its pp ranks, and bring the ideal bubble, (p-1)/(v·m+p-1), to 10%;
    else one sample each."""
    split = [m for m in range(pp, batch + 1) if batch % m == 0]
    return next((m for m in split if 100 * (pp - 1) / (stages_per_rank * m + pp - 1) <= 10), split[-1])


def table_md_rows(path):
    """The data rows of a GitHub-style Markdown table, as lists of cell strings."""
    lines = [line for line in open(path) if line.startswith("|")][2:]  # skip header and rule
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def test_every_row_runs_the_batch_and_flags_it_announces_on_gpus(stub_sweep):
    proc, runs = run_sweep(stub_sweep, "--float8", "rowwise", "--global-batch-size", "4", gpus=(2, 80, "NVIDIA H100 80GB HBM3"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model 2.5b, 20 steps per run, compiled" in proc.stdout.splitlines()[0]
    kinds = {(fields[2], fields[4] or "") for fields, _ in runs}
    # Every strategy measured at 1 and 2 GPUs, predicted at 2, with a float8 twin of each measured row.
    assert {s for s, _ in kinds} == set(STRATEGIES) and {k.split(" rank")[0] for _, k in kinds} == {"", " simulated", " float8"}
    measured_flags = {}
    for (_, _, script, n, kind, batch, flags, note, outcome), got in runs:
        argv, n, kind = got["argv"], int(n), kind or ""
        assert outcome.endswith(" s") and got["script"] == script, (script, n, kind, outcome)
        # One job per count: every strategy at n GPUs trains 4 x n, and says so.
        assert int(batch) == 4 * n and value(argv, "--global-batch-size") == batch
        # Exactly the flags it announces, beyond those every run gets; compiled, the baseline included.
        assert own_flags(argv) == (flags or ""), (script, n, kind, argv)
        assert "--compile" in argv and value(argv, "--model") == "2.5b"
        if kind.startswith(" simulated"):
            assert value(argv, "--simulate") == str(n) and got["world"] == n
        else:  # the report draws every measured row's bytes
            assert got["world"] == n and "--simulate" not in argv and "--count-comm" in argv
        if kind == "":
            measured_flags[script, n] = flags or ""
        if kind == " float8":  # the strategy's own settings, as its bf16 row ran them, and float8
            assert (flags or "") == f"{measured_flags[script, n]} --float8 rowwise".strip(), (script, n, flags)
        if script in ("pipeline", "hybrid"):  # the fewest micro-batches that make the bubble small, as the run got them
            pp = int(value(argv, "--pp")) if script == "hybrid" else n
            per_rank = int(value(argv, "--stages-per-rank")) if "--stages-per-rank" in argv else 1
            assert int(value(argv, "--micro-batches")) == fewest_micro_batches(int(batch) // (n // pp), pp, per_rank), (script, n, argv)
    # The table shows each row's flags as its record's config has them, and the batch of the job.
    table = table_md_rows(stub_sweep / "results" / os.listdir(stub_sweep / "results")[0] / "table.md")
    shown = {(row[0].replace("single-GPU baseline", "ddp"), int(row[1])): row for row in table if "predicted" not in row[0]}
    for (script, n), flags in measured_flags.items():
        name = STRATEGY_OF_SCRIPT.get(script, script)
        assert shown[name, n][-1] == (flags or "-") and shown[name, n][2] == str(4 * n), (script, n)
        assert shown[f"{name} float8 rowwise", n][-1] == (flags or "-")
    # Settings chosen, not fixed: the row is the fastest of those tried.
    assert measured_flags["pipeline", 2] in {"--schedule interleaved-1f1b --micro-batches 4 --stages-per-rank 2", "--schedule 1f1b --micro-batches 8"}


@pytest.mark.parametrize("slower", ["interleaved-1f1b", "--schedule 1f1b", "--sequence-parallel"])
def test_the_measured_row_runs_the_fastest_settings_tried(stub_sweep, slower):
    proc, runs = run_sweep(stub_sweep, "--strategies", "pipeline,tensor_parallel", "--gpus", "1,2", gpus=(2, 80, "NVIDIA H100 80GB HBM3"),
                           knobs={"slower": {slower: 50}})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tried = {(script, n): [] for (_, _, script, n, *_), _ in runs}
    for (_, _, script, n, kind, _, flags, note, _), _ in runs:
        if kind == " simulated rank 0":
            tried[script, n].append(flags or "")
        elif not kind and n == "2":
            assert len(tried[script, n]) == 2 and slower not in (flags or "") and (flags or "") in tried[script, n], (script, flags, tried)
            assert "the fastest of 2 settings tried" in note


def test_a_row_out_of_memory_runs_again_checkpointed_and_says_so(stub_sweep):
    proc, runs = run_sweep(stub_sweep, "--strategies", "ddp,tensor_parallel", "--gpus", "1,2", "--eager", gpus=(2, 80, "NVIDIA H100 80GB HBM3"),
                           knobs={"oom": ["tensor_parallel"]})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all("--compile" not in got["argv"] for _, got in runs)  # --eager: no row compiles
    tp = [(fields, got["argv"]) for fields, got in runs if fields[2] == "tensor_parallel" and fields[3] == "2"]
    # Each simulated settings ran out of memory, then ran checkpointed; the measured row takes the fastest of those.
    assert [(f[4], f[6], "FAILED" if f[8].startswith("FAILED") else "ok") for f, _ in tp] == [
        (" simulated rank 0", "--sequence-parallel", "FAILED"), (" simulated rank 0", "--sequence-parallel --activation-checkpointing", "ok"),
        (" simulated rank 0", None, "FAILED"), (" simulated rank 0", "--activation-checkpointing", "ok"), (None, tp[-1][0][6], "ok")]
    assert "--activation-checkpointing" in tp[-1][1] and "out of memory: the row again with --activation-checkpointing" in proc.stdout
    folder = stub_sweep / "results" / os.listdir(stub_sweep / "results")[0]
    assert "`--sequence-parallel`: error: rank 0 ran out of memory" in (folder / "REPORT.md").read_text()


def test_the_cpu_sweep_runs_one_job_per_count_reports_failures_and_exits_non_zero(stub_sweep):
    proc, runs = run_sweep(stub_sweep, "--strategies", "ddp,context_parallel,model_parallel,fsdp", "--strong", "--global-batch-size", "6",
                           knobs={"fail": ["fsdp"]}, env={"OMP_NUM_THREADS": "7", "MODEL": "350m", "GPUS": "4", "OUT": "elsewhere"})
    assert proc.returncode == 1 and proc.stderr.splitlines()[-1] == "run_all.sh: 3 of 12 rows failed (their lines above say why)", proc.stderr
    assert "No GPU in use: CPU fallback, model tiny in 1-2 gloo processes, 10 steps per run, eager" in proc.stdout.splitlines()[0]
    # On CPU: 1 and 2 processes measured, 2 predicted, one batch for every strategy and count (--strong), no compile, one thread.
    assert {(f[2], f[3], f[4] or "") for f, _ in runs} == {(s, n, k) for s in ("ddp", "context_parallel", "model_parallel", "fsdp")
                                                           for n, k in (("2", " simulated rank 0"), ("1", ""), ("2", ""))} | {
        ("model_parallel", "2", " simulated rank 1")}
    assert all(value(got["argv"], "--global-batch-size") == "6" and "--compile" not in got["argv"] and got["threads"] == "1" for _, got in runs)
    assert not (stub_sweep / "elsewhere").exists()
    table = table_md_rows(stub_sweep / "results" / os.listdir(stub_sweep / "results")[0] / "table.md")
    assert [row[3] for row in table if row[0].startswith("fsdp")] == ["failed: error: broken on purpose"] * 2 + ["rank 0: error: broken on purpose"]
    assert [row[0] for row in table if "cp" in row[0]] == ["cp", "cp", "cp (predicted)"]  # the record's name, one row each


def test_a_long_cpu_row_says_so_before_it_starts(stub_sweep):
    proc, runs = run_sweep(stub_sweep, "--model", "350m", "--strategies", "ddp", "--gpus", "1", "--simulate", "none")
    assert proc.returncode == 0, proc.stderr
    [(fields, _)] = runs
    assert re.fullmatch(r"at least \d+ min on CPU", fields[7]), fields


def test_on_one_gpu_the_last_line_says_how_to_predict_more(stub_sweep):
    proc, _ = run_sweep(stub_sweep, "--strategies", "ddp", gpus=(1, 80, "NVIDIA H100 80GB HBM3"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("One GPU here: bash run_all.sh --simulate 2,4,8 predicts 2, 4 and 8 GPUs")
    proc, _ = run_sweep(stub_sweep, "--strategies", "ddp", "--simulate", "2", gpus=(1, 80, "NVIDIA H100 80GB HBM3"))
    assert proc.returncode == 0 and not proc.stdout.splitlines()[-1].startswith("One GPU here"), proc.stdout


# Each bad option, and what its one line must say. A "{taken}" folder holds a file.
BAD_OPTIONS = [
    (["--model", "huge"], ",".join(common.PRESETS)),
    (["--model"], "needs a value"),
    (["--steps", "0"], "positive whole number"),
    (["--steps", "x"], "positive whole number"),
    (["--steps", "1"], "at least 5"),
    (["--steps", "4"], "at least 5"),
    (["--steps", "99999999999999999999"], "positive whole number"),
    (["--steps", "7", "--steps", "8"], "given twice"),
    (["--profile", "--steps", "9"], "at least 10"),
    (["--gpus", "1,x"], "positive counts"),
    (["--gpus", "0"], "positive counts"),
    (["--gpus", "1,,2"], "positive counts"),
    (["--gpus", "1,1"], "1 is named twice"),
    (["--gpus", "4"], "at most 2 processes"),
    (["--simulate", "1"], "counts of 2 or more"),
    (["--simulate", "2,2"], "2 is named twice"),
    (["--simulate", "5000"], "at most 4096"),
    (["--simulate", "-2"], "counts of 2 or more"),
    (["--strategies", "ddp,nope"], "accepted: context_parallel,ddp"),
    (["--strategies", "ddp,,fsdp"], "an empty name"),
    (["--strategies", "ddp,ddp"], "named twice"),
    (["--strategies", ","], "an empty name"),
    (["--global-batch-size", "-1"], "positive whole number"),
    (["--global-batch-size", "0"], "positive whole number"),
    (["--strategies", "ddp", "--gpus", "2", "--simulate", "none", "--strong", "--global-batch-size", "3"],
     "nothing to run: ddp x2 global batch 3 does not split over 2 ranks"),
    (["--strategies", "context_parallel", "--seq-len", "3", "--simulate", "none"], "nothing to run: context_parallel x1 3 tokens"),
    (["--seq-len", "65"], "tiny preset's context of 64"),
    (["--seq-len", "0"], "positive whole number"),
    (["--out", "{taken}"], "holds files already"),
    (["--out", "{taken}/file"], "exists and is not a folder"),
    (["--out", "{taken}/file/below"], "exists and is not a folder|cannot be made"),
    (["--float8", "e4m3"], "tensorwise or rowwise"),
    (["--float8", "rowwise"], "needs a GPU"),
    (["--compile", "--eager"], "contradict"),
    (["--intra-gbps", "0"], "positive number of GB/s"),
    (["--intra-gbps", "-5"], "positive number of GB/s"),
    (["--inter-gbps", "nan"], "positive number of GB/s"),
    (["--intra-gbps", "100", "--simulate", "none"], "it needs --simulate"),
    (["--gpus-per-node", "0"], "positive whole number"),
    (["--wat"], "unknown option --wat"),
    (["extra"], "unknown option extra"),
]


@pytest.mark.parametrize("args, cause", BAD_OPTIONS, ids=[" ".join(args) for args, _ in BAD_OPTIONS])
def test_a_bad_option_is_refused_in_one_line_before_anything_runs(stub_sweep, tmp_path, args, cause):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("{}\n")
    args = [a.format(taken=tmp_path / "taken") for a in args]
    def files():
        return sorted(p for p in stub_sweep.rglob("*") if "__pycache__" not in p.parts and p.name not in ("machine.json", "stub.json"))

    before = files()
    proc, runs = run_sweep(stub_sweep, "--cpu", *args)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("run_all.sh: ") and re.search(cause, proc.stderr), proc.stderr
    assert runs == [] and files() == before  # no results folder, no run


def test_two_sweeps_into_one_out_folder_one_is_refused_in_one_line(stub_sweep, tmp_path):
    (stub_sweep / "machine.json").write_text("[0, 0, \"none\"]")
    env = {**os.environ, "PATH": stub_path(stub_sweep)}
    out = tmp_path / "shared"
    procs = [subprocess.Popen(["bash", "run_all.sh", "--strategies", "ddp", "--gpus", "1", "--simulate", "none", "--out", str(out)],
                              cwd=stub_sweep, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    codes = sorted(proc.returncode for proc in procs)
    refused = [err for proc, (_, err) in zip(procs, outputs) if proc.returncode]
    assert codes == [0, 2] and len(refused[0].splitlines()) == 1, outputs
    assert re.match(rf"run_all.sh: --out {out}: (another sweep took it first|holds files already)", refused[0]), refused
    assert (out / "table.md").exists()


def test_two_sweeps_started_in_the_same_second_get_folders_of_their_own(stub_sweep):
    # A clock stuck on one second, for both sweeps.
    (stub_sweep / "bin" / "date").write_text("#!/bin/sh\necho 20250101-000000\n")
    (stub_sweep / "bin" / "date").chmod(stat.S_IRWXU)
    (stub_sweep / "machine.json").write_text("[0, 0, \"none\"]")
    env = {**os.environ, "PATH": stub_path(stub_sweep)}
    procs = [subprocess.Popen(["bash", "run_all.sh", "--strategies", "ddp", "--gpus", "1", "--simulate", "none"], cwd=stub_sweep, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    assert [proc.communicate(timeout=120) and proc.returncode for proc in procs] == [0, 0]
    folders = sorted((stub_sweep / "results").iterdir())
    assert len(folders) == 2 and all(f.name.startswith("20250101-000000-") and (f / "table.md").exists() for f in folders), folders


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z"


def parent(pid):
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def hanging_sweep(folder, how):
    """A stub sweep whose second row, fsdp x2, runs the real torchrun (its ranks in sessions
    of their own) on 2 processes of a stub that hangs, after a row that finished."""
    sweep = make_stub_sweep(folder / "sweep")
    (sweep / "machine.json").write_text("[0, 0, \"none\"]")
    (sweep / "stub.json").write_text(json.dumps({"hang": ["fsdp"]}))
    env = {**os.environ, "PATH": stub_path(sweep), "REAL_TORCHRUN": "fsdp_train.py"}
    with open(folder / "stdout", "w") as stdout, open(folder / "stderr", "w") as stderr:
        return subprocess.Popen(["bash", "run_all.sh", "--strategies", "ddp,fsdp", "--gpus", "2", "--simulate", "none", "--out", str(folder / "out")],
                                cwd=sweep, env=env, stdout=subprocess.PIPE if how == "reader left" else stdout, stderr=stderr,
                                text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a terminal's job, whatever this run inherited


def end_hanging_sweep(folder, proc, how):
    """Once both ranks hang, end the sweep as `how` does; returns (seconds until the sweep,
    its torchrun and its ranks were gone, those still alive)."""
    deadline, ranks = time.monotonic() + 120, []
    while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
        ranks = [int(p.suffix[1:]) for p in (folder / "sweep").glob("hung.*")]
    assert len(ranks) == 2 and proc.poll() is None, (folder / "stdout").read_text() + (folder / "stderr").read_text()
    processes = ranks + [parent(ranks[0])]  # and torchrun
    start = time.monotonic()
    if how == "Ctrl-C":
        os.killpg(proc.pid, signal.SIGINT)
    elif how in ("SIGTERM", "SIGKILL"):
        proc.send_signal(getattr(signal, how))
    else:
        proc.stdout.close()
    proc.wait(timeout=30)
    while [pid for pid in processes if alive(pid)] and time.monotonic() < start + 30:
        time.sleep(0.1)
    left = [pid for pid in processes if alive(pid)]
    for pid in left:  # a sweep that failed to end them must not leave them behind
        os.kill(pid, signal.SIGKILL)
    return time.monotonic() - start, left


def test_a_signal_ends_the_sweep_and_its_running_ranks_within_seconds_and_reports_what_finished(tmp_path):
    """Ctrl-C is SIGINT to the terminal's process group, SIGTERM to the sweep, a reader that
    left (`| head`) closes the sweep's output; a sweep killed outright can say nothing, but
    its ranks still end. The four sweeps start side by side: each waits on torchrun."""
    folders = {how: tmp_path / how.replace(" ", "-") for how in ["Ctrl-C", "SIGTERM", "reader left", "SIGKILL"]}
    procs = {how: hanging_sweep(folder, how) for how, folder in folders.items()}
    try:
        for how, proc in procs.items():
            folder = folders[how]
            seconds, left = end_hanging_sweep(folder, proc, how)
            assert seconds < 15 and not left, (how, seconds, left)
            if how == "SIGKILL":
                continue
            stdout, stderr = (folder / "stdout").read_text(), (folder / "stderr").read_text()
            name, code = {"Ctrl-C": ("SIGINT", 130), "SIGTERM": ("SIGTERM", 143), "reader left": ("SIGPIPE", 141)}[how]
            assert proc.returncode == code, (how, proc.returncode, stderr)
            lines = stderr.splitlines()
            assert len(lines) == 1 and re.fullmatch(rf"run_all.sh: {name} during \[2/2\]: 1 of 2 runs finished \(ddp x2\); the table below is theirs",
                                                    lines[0]), (how, stderr)
            assert "Traceback" not in stdout + stderr, how
            assert how == "reader left" or "[2/2] fsdp x2, global batch 16 ... interrupted after" in stdout, (how, stdout)
            assert [(row[0], row[1]) for row in table_md_rows(folder / "out" / "table.md")] == [("ddp", "2")], how
    finally:
        for how, proc in procs.items():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            for path in (folders[how] / "sweep").glob("hung.*"):
                if alive(int(path.suffix[1:])):
                    os.kill(int(path.suffix[1:]), signal.SIGKILL)


def test_exported_out_and_model_do_not_steer_the_sweep(stub_sweep, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    env = {"OUT": str(elsewhere), "out": str(elsewhere), "MODEL": "350m", "model": "350m", "STEPS": "7", "SCALING": "strong", "steps": "7"}
    proc, runs = run_sweep(stub_sweep, "--strategies", "ddp", "--gpus", "1", "--simulate", "none", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "model tiny in 1-2 gloo processes, 10 steps per run" in proc.stdout.splitlines()[0]
    assert [value(got["argv"], "--steps") for _, got in runs] == ["10"] and not elsewhere.exists()
    [folder] = (stub_sweep / "results").iterdir()
    assert (folder / "table.md").exists()


def test_cpu_sweep_reports_what_the_runs_measured(tmp_path, monkeypatch):
    """The real scripts, end to end: the table must be the figures their runs wrote, and
    the measured row the settings its simulated ranks predicted fastest. (The baseline's
    arithmetic, which stubs check in test_sweep_report, is left out: a run each is seconds.)"""
    for name in ("run_all.sh", "sweep_report.py", "common.py", "pipeline_train.py"):
        shutil.copy(ROOT / name, tmp_path)
    shutil.copytree(ROOT / "options", tmp_path / "options")
    shutil.copytree(ROOT / "sweep", tmp_path / "sweep")
    out = tmp_path / "out"
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    proc = subprocess.run(["bash", "run_all.sh", "--cpu", "--strategies", "pipeline", "--gpus", "2", "--steps", "5", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    announced = [m.groups() for m in map(ANNOUNCED.match, proc.stdout.splitlines()) if m]
    assert [(a[2], a[3], a[4]) for a in announced] == [*[("pipeline", "2", f" simulated rank {r}") for r in (0, 1, 0, 1)], ("pipeline", "2", None)]
    simulated = [json.loads(line) for line in open(out / "simulated.jsonl")]
    [record] = map(json.loads, open(out / "results.jsonl"))
    assert (record["strategy"], record["world_size"], record["model"], record["steps"], record["global_batch_size"]) == ("pipeline", 2, "tiny", 5, 16)
    # Every run ran the flags its row announced, as its record's config has them.
    for a, r in zip(announced, [*simulated, record]):
        assert flags_of(r) == (a[6] or "") and r["global_batch_size"] == int(a[5]) and r["config"]["compile"] is False, (a, r["config"])
    # The measured row ran the settings predicted fastest of the two tried.
    predicted = candidate_predictions(simulated, [], (*link_bandwidth(None)[:2], 8))[("pipeline", 2, 16)]
    fastest = max(predicted.values(), key=predicted_rate)
    assert len(predicted) == 2 and flags_of(record) == fastest["flags"]
    table = table_md_rows(out / "table.md")
    assert [(row[0], row[1]) for row in table] == [("pipeline", "2"), ("pipeline (predicted)", "2")]
    assert table[0][2:4] == [str(record["global_batch_size"]), f"{record['samples_per_sec']:.2f}"]
    assert table[0][7] == f"{record['peak_mem_gib']:.2f} ({record['mem_pct']:.0f}%)" and table[0][-1] == table[1][-1] == fastest["flags"]
    # The report: REPORT.md and its five pictures, ending with the ranking at each count.
    report = (out / "REPORT.md").read_text()
    for name in PICTURES.values():
        assert f"]({name})" in report and 0 < (out / name).stat().st_size < 200_000, name
    assert report.rstrip().splitlines()[-1].startswith(f"- 2 processes, tiny, global batch 16 (measured): pipeline {record['samples_per_sec']:.2f} samples/s")
    assert "## Settings tried" in report
