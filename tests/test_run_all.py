"""run_all.sh and sweep_report.py. The table's maths on hostile input, from made-up
records; the options the sweep refuses; a folder of its own for every sweep, whatever the
environment says; and one CPU sweep end to end: the table must be the figures its runs
wrote, a failing run must be reported and the sweep go on, every row with the same threads."""

import json
import os
import re
import shutil
import stat
import subprocess

import pytest

import common
import sweep_report
from harness import ROOT


def record(strategy, world_size, samples_per_sec, global_batch_size=8, **extra):
    """A results line as the scripts write it, with only the fields the table reads."""
    return {"strategy": strategy, "world_size": world_size, "global_batch_size": global_batch_size, "samples_per_sec": samples_per_sec,
            "mfu": None, "peak_mem_gib": 1.0, "mem_pct": 10.0, "comm_pct": None, **extra}


def failure(script, world_size, global_batch_size=8):
    """A failures line as run_all.sh writes it: the script's name, not the record's."""
    return {"strategy": script, "world_size": world_size, "global_batch_size": global_batch_size, "error": "error: out of memory", "log": "x.log"}


def rows_of(tmp_path, records, failures=()):
    """The table sweep_report makes of these lines, as {(strategy, GPUs): row}, and its row order."""
    for name, lines in (("results.jsonl", records), ("failures.jsonl", failures)):
        (tmp_path / name).write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = sweep_report.table_rows(*sweep_report.load(tmp_path))
    return {(row[0], int(row[1])): row for row in rows}, [(row[0], int(row[1])) for row in rows]


def test_the_baseline_is_ddp_at_one_gpu_wherever_it_sits(tmp_path):
    rows, _ = rows_of(tmp_path, [record("pipeline", 1, 50.0), record("ddp", 2, 150.0, 16), record("tp", 2, 40.0), record("ddp", 1, 100.0)])
    # Speedup and efficiency against ddp x1's 100 samples/s, not the pipeline's 50.
    assert [rows[key][4:6] for key in [("single-GPU baseline", 1), ("ddp", 2), ("pipeline", 1), ("tp", 2)]] == [
        ["1.00x", "100%"], ["1.50x", "75%"], ["0.50x", "50%"], ["0.40x", "20%"]]


def test_without_a_baseline_there_is_no_speedup(tmp_path):
    rows, _ = rows_of(tmp_path, [record("pipeline", 1, 50.0), record("ddp", 2, 150.0, 16)])
    assert [row[4:6] for row in rows.values()] == [["-", "-"], ["-", "-"]]
    # A baseline that failed is no baseline either.
    rows, _ = rows_of(tmp_path, [record("ddp", 2, 150.0, 16)], [failure("ddp", 1)])
    assert rows["single-GPU baseline", 1][3:6] == ["failed: error: out of memory", "-", "-"] and rows["ddp", 2][4:6] == ["-", "-"]


def test_a_run_that_appears_twice_shows_once_by_its_newest_line(tmp_path):
    rows, order = rows_of(tmp_path, [record("ddp", 1, 100.0), record("ddp", 2, 120.0, 16), record("ddp", 2, 180.0, 16)])
    assert order == [("single-GPU baseline", 1), ("ddp", 2)]
    assert rows["ddp", 2][3:5] == ["180.00", "1.80x"]


def test_a_failed_run_shows_as_failed_not_as_zero(tmp_path):
    # fsdp x2 also wrote figures before it failed: it still shows once, as failed.
    rows, order = rows_of(tmp_path, [record("ddp", 1, 100.0), record("fsdp", 2, 90.0, 16)], [failure("fsdp", 2, 16), failure("tensor_parallel", 2)])
    assert order == [("single-GPU baseline", 1), ("fsdp", 2), ("tp", 2)]
    for key in [("fsdp", 2), ("tp", 2)]:
        assert rows[key][3:] == ["failed: error: out of memory", "-", "-", "-", "-", "-", "-"]


def test_rows_come_in_the_articles_order_whatever_the_input_order(tmp_path):
    records = [record("zeta", 1, 1.0), record("tp", 2, 1.0), record("fsdp", 2, 1.0, 16), record("alpha", 2, 1.0), record("hybrid", 2, 1.0, 8),
               record("ddp", 2, 1.0, 16), record("pipeline", 2, 1.0), record("model_parallel", 2, 1.0), record("ddp", 1, 1.0), record("alpha", 1, 1.0)]
    _, order = rows_of(tmp_path, records, [failure("tensor_parallel", 1), failure("model_parallel", 1)])
    assert order == [("single-GPU baseline", 1), ("ddp", 2), ("model_parallel", 1), ("model_parallel", 2), ("pipeline", 2), ("hybrid", 2),
                     ("fsdp", 2), ("tp", 1), ("tp", 2), ("alpha", 1), ("alpha", 2), ("zeta", 1)]


def test_a_step_splits_into_what_its_results_line_measured():
    parts = {"data": 1.0, "to_optimizer": 7.0, "optimizer": 2.0}
    # DDP measured 3 s of exposed communication apart: compute is the rest of the span.
    split = sweep_report.step_split(record("ddp", 2, 1.0, step_seconds=10.0, step_parts_seconds=parts, comm_seconds=3.0))
    assert split == {"data": 1.0, "compute": 3.0, "comm": 3.0, "bubble": None, "optimizer": 2.0, "rest": 1.0}
    # One GPU communicates nothing; elsewhere unmeasured communication is no figure (it sits in compute).
    assert sweep_report.step_split(record("ddp", 1, 1.0, step_seconds=10.0, step_parts_seconds=parts))["comm"] == 0.0
    assert sweep_report.step_split(record("fsdp", 2, 1.0, step_seconds=10.0, step_parts_seconds=parts))["compute"] == 6.0
    # A pipeline's ranks were busy 40% of the step, 2 s of it in the optimizer: the span's other 4 s are the bubble.
    split = sweep_report.step_split(record("pipeline", 2, 1.0, step_seconds=10.0, step_parts_seconds=parts, utilisation_pct=40.0))
    assert split == {"data": 1.0, "compute": 2.0, "comm": None, "bubble": 4.0, "optimizer": 2.0, "rest": 1.0}
    assert sweep_report.step_split(record("tp", 2, 1.0, step_seconds=10.0)) is None  # a line from before the split


def test_a_sweep_folder_copied_off_its_machine_still_links_its_profiles(tmp_path, monkeypatch):
    # A GPU box's sweep, copied here: its lines name the folders it profiled into over there.
    (tmp_path / "profiles" / "ddp_x1").mkdir(parents=True)
    (tmp_path / "profiles" / "ddp_x1" / "ops_rank0.txt").write_text("aten::mm\n")
    line = record("ddp", 1, 1.0, model="tiny", params=1, seq_len=8, losses=[1.0], start_step=0, step_seconds=1.0, gpu_name=None, device="cpu", config={"profile": "/root/out/sweep/profiles/ddp_x1"})
    (tmp_path / "results.jsonl").write_text(json.dumps(line) + "\n")
    monkeypatch.setattr(sweep_report, "_pyplot", lambda: None)
    sweep_report.write_report(tmp_path, *sweep_report.load(tmp_path), (*sweep_report.link_bandwidth(None)[:2], 8), "TABLE", [])
    assert "| ddp x1 | not here | [ops_rank0.txt](profiles/ddp_x1/ops_rank0.txt) |" in (tmp_path / "REPORT.md").read_text()


def test_a_float8_run_is_a_row_of_its_own_after_its_strategy(tmp_path):
    float8 = record("ddp", 1, 150.0, config={"float8": "tensorwise"})
    rows, order = rows_of(tmp_path, [float8, record("fsdp", 1, 90.0), record("ddp", 1, 100.0)], [{**failure("fsdp", 1), "float8": "rowwise"}])
    assert order == [("single-GPU baseline", 1), ("ddp float8 tensorwise", 1), ("fsdp", 1), ("fsdp float8 rowwise", 1)]
    # Against the bf16 baseline, not its own.
    assert rows["ddp float8 tensorwise", 1][4] == "1.50x" and rows["fsdp float8 rowwise", 1][3].startswith("failed")


@pytest.fixture
def sweep_dir(tmp_path):
    """A copy of the sweep whose only strategy, ddp_train.py, leaves a file "ran" if it is run."""
    folder = tmp_path / "sweep"
    folder.mkdir()
    for name in ("run_all.sh", "sweep_report.py", "common.py"):
        shutil.copy(ROOT / name, folder)
    (folder / "ddp_train.py").write_text("open('ran', 'w').close()\n")
    (folder / "taken").mkdir()
    (folder / "taken" / "results.jsonl").write_text("{}\n")
    return folder


def files_under(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "__pycache__" not in p.parts)


# Each bad option, and what its one line must say is accepted.
BAD_OPTIONS = [
    (["--model", "huge"], ",".join(common.PRESETS)),
    (["--steps", "0"], "positive whole number"),
    (["--steps", "x"], "positive whole number"),
    (["--gpus", "1,x"], "positive counts"),
    (["--gpus", "0"], "positive counts"),
    (["--strategies", "ddp,nope"], "accepted: ddp"),
    (["--global-batch-size", "-1"], "positive whole number"),
    (["--out", "taken"], "new or empty"),
    (["--model"], "needs a value"),
    (["--float8", "e4m3"], "tensorwise or rowwise"),
    (["--seq-len", "65"], "tiny preset's context of 64"),
]


@pytest.mark.parametrize("args, accepted", BAD_OPTIONS, ids=[" ".join(args) for args, _ in BAD_OPTIONS])
def test_a_bad_option_is_refused_in_one_line_before_anything_runs(sweep_dir, args, accepted):
    before = files_under(sweep_dir)
    proc = subprocess.run(["bash", "run_all.sh", "--cpu", *args], cwd=sweep_dir, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"run_all.sh: {' '.join(args)}") and accepted in proc.stderr, proc.stderr
    assert files_under(sweep_dir) == before  # no results folder, no run


def no_run_sweep(folder, env, count=1):
    """`count` sweeps at once that plan nothing but skips (3 processes, where the CPU
    fallback allows 2): each makes its folder and its (empty) table, quickly."""
    procs = [subprocess.Popen(["bash", "run_all.sh", "--cpu", "--strategies", "ddp", "--gpus", "3"], cwd=folder, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (stdout, stderr) in zip(procs, outputs):
        assert proc.returncode == 0, stdout + stderr
        assert "[1/1] ddp x3 ... skipped (only 2 processes here)" in stdout, stdout
    return [stdout for stdout, _ in outputs]


def test_float8_adds_a_run_of_every_row_and_compile_reaches_every_run(sweep_dir):
    (sweep_dir / "ddp_train.py").write_text("import json, sys\nopen('argv.jsonl', 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n")
    proc = subprocess.run(["bash", "run_all.sh", "--cpu", "--strategies", "ddp", "--gpus", "1", "--simulate", "none",
                           "--compile", "--float8", "rowwise"], cwd=sweep_dir, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [json.loads(line) for line in open(sweep_dir / "argv.jsonl")]
    assert len(runs) == 2 and all("--compile" in argv for argv in runs), runs
    assert ["--float8" in argv for argv in runs] == [False, True] and runs[1][runs[1].index("--float8") + 1] == "rowwise"


def test_two_sweeps_started_in_the_same_second_get_folders_of_their_own(sweep_dir):
    # A clock stuck on one second, for both sweeps.
    fake_bin = sweep_dir / "bin"
    fake_bin.mkdir()
    (fake_bin / "date").write_text("#!/bin/sh\necho 20250101-000000\n")
    (fake_bin / "date").chmod(stat.S_IRWXU)
    no_run_sweep(sweep_dir, {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}, count=2)
    folders = sorted((sweep_dir / "results").iterdir())
    assert len(folders) == 2 and all(f.name.startswith("20250101-000000-") and (f / "table.md").exists() for f in folders), folders


def test_exported_out_and_model_do_not_steer_the_sweep(sweep_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    env = {**os.environ, "OUT": str(elsewhere), "out": str(elsewhere), "MODEL": "350m", "model": "350m", "STEPS": "7", "SCALING": "strong"}
    [stdout] = no_run_sweep(sweep_dir, env)
    assert "model tiny in 1-2 gloo processes, weak scaling, 10 steps per run" in stdout.splitlines()[0]
    assert not elsewhere.exists()
    [folder] = (sweep_dir / "results").iterdir()
    assert (folder / "table.md").exists()


def table_md_rows(path):
    """The data rows of a GitHub-style Markdown table, as lists of cell strings."""
    lines = [line for line in open(path) if line.startswith("|")][2:]  # skip header and rule
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def test_cpu_sweep_reports_what_the_runs_measured(tmp_path, monkeypatch):
    for name in ("run_all.sh", "sweep_report.py", "common.py", "ddp_train.py", "pipeline_train.py"):
        shutil.copy(ROOT / name, tmp_path)
    shutil.copytree(ROOT / "options", tmp_path / "options")
    # A strategy that fails, after noting the threads each of its ranks was given.
    (tmp_path / "broken_train.py").write_text(
        "import json, os, sys\n"
        "with open('threads.jsonl', 'a') as f:\n"
        "    f.write(json.dumps([os.environ.get('WORLD_SIZE', '1'), os.environ.get('OMP_NUM_THREADS')]) + '\\n')\n"
        "print('error: broken on purpose', file=sys.stderr)\n"
        "sys.exit(2)\n")
    out = tmp_path / "out"
    # Generic variables another tool may have set must not reach the runs.
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.update(MODEL="gpt2", STEPS="7", STRATEGIES="fsdp", GPUS="4", GLOBAL_BATCH="3", SCALING="strong", OUT=str(tmp_path / "elsewhere"))
    proc = subprocess.run(["bash", "run_all.sh", "--cpu", "--strategies", "ddp,broken,pipeline", "--gpus", "1,2", "--simulate", "2",
                           "--steps", "3", "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CPU fallback" in proc.stdout.splitlines()[0]
    assert "[1/9] ddp x1 ... " in proc.stdout and "[8/9] pipeline x2 " in proc.stdout
    assert "[4/9] broken x1 ... FAILED" in proc.stdout and "(log: " in proc.stdout
    # Each distinct rank of a simulated run once: DDP's ranks are alike, a pipeline's ends are not.
    assert "[3/9] ddp x2 simulated rank 0 ... " in proc.stdout and "[6/9] broken x2 simulated rank 0 ... FAILED" in proc.stdout
    assert "[9/9] pipeline x2 simulated rank 0 " in proc.stdout and "[9/9] pipeline x2 simulated rank 1 " in proc.stdout
    simulated = {(r["strategy"], r["world_size"], r["simulated_rank"]) for r in map(json.loads, open(out / "simulated.jsonl"))}
    assert simulated == {("ddp", 2, 0), ("pipeline", 2, 0), ("pipeline", 2, 1)}

    records = {(r["strategy"], r["world_size"]): r for r in map(json.loads, open(out / "results.jsonl"))}
    assert set(records) == {("ddp", 1), ("ddp", 2), ("pipeline", 1), ("pipeline", 2)}
    assert {(r["model"], r["steps"]) for r in records.values()} == {("tiny", 3)}
    base = records["ddp", 1]["samples_per_sec"]
    table = table_md_rows(out / "table.md")
    # Article order: baseline, data parallel, pipeline; then strategies it does not have. A
    # predicted row follows the measured one of the same run.
    assert [(row[0], row[1]) for row in table] == [("single-GPU baseline", "1"), ("ddp", "2"), ("ddp (predicted)", "2"), ("pipeline", "1"),
                                                   ("pipeline", "2"), ("pipeline (predicted)", "2"), ("broken", "1"), ("broken", "2"),
                                                   ("broken (predicted)", "2")]
    predicted = {row[0]: row for row in table if "predicted" in row[0]}
    assert predicted["broken (predicted)"][3] == "rank 0: error: broken on purpose"
    assert "bubble" in predicted["pipeline (predicted)"][8] and predicted["ddp (predicted)"][8].startswith("comm ")
    # The measured row says where it falls against its prediction.
    assert re.fullmatch(r"within|[+-]\d+% (above|below)", table[4][9]), table[4]
    rows = [row for row in table if "predicted" not in row[0]]
    for row in rows[:4]:
        strategy = "ddp" if row[0] == "single-GPU baseline" else row[0]
        r = records[strategy, int(row[1])]
        speedup = r["samples_per_sec"] / base
        overhead = f"comm {r['comm_pct']:.1f}" if strategy == "ddp" and r["world_size"] > 1 else (
            f"bubble {r['bubble_pct']:.1f}" if strategy == "pipeline" else "-")
        assert row[2:] == [str(r["global_batch_size"]), f"{r['samples_per_sec']:.2f}", f"{speedup:.2f}x",
                           f"{100 * speedup / r['world_size']:.0f}%", "-", f"{r['peak_mem_gib']:.2f} ({r['mem_pct']:.0f}%)", overhead, row[9]]
    # Weak scaling: the data-parallel row doubles the batch, the pipeline keeps it.
    assert records["ddp", 2]["global_batch_size"] == 16 and records["pipeline", 2]["global_batch_size"] == 8
    assert rows[4][3] == "failed: error: broken on purpose"
    # The micro-batches each pipeline row announced are the ones it ran.
    for n in (1, 2):
        announced = re.search(rf"pipeline x{n} .*--micro-batches (\d+) \.\.\. ", proc.stdout)
        assert announced and int(announced[1]) == records["pipeline", n]["config"]["micro_batches"], proc.stdout
    # One thread per process in every row, the 1-process ones included.
    threads = [tuple(json.loads(line)) for line in open(tmp_path / "threads.jsonl")]
    assert sorted(threads) == [("1", "1"), ("1", "1"), ("2", "1"), ("2", "1")], threads
    assert not (tmp_path / "elsewhere").exists()

    # The report: REPORT.md and its five pictures, each number in them from the lines above.
    report = (out / "REPORT.md").read_text()
    for name in sweep_report.PICTURES.values():
        assert f"]({name})" in report and 0 < (out / name).stat().st_size < 200_000, name
    lines = sweep_report.load(out)
    bandwidth = (*sweep_report.link_bandwidth(None)[:2], 8)  # run_all.sh's defaults
    data = sweep_report.figures(*lines, bandwidth)
    measured = {sweep_report.name_of(key): r for key, r in records.items()}
    bars = {bar["name"]: bar for bar in data["split"]["bars"]}
    assert list(bars) == ["ddp x1", "ddp x2", "ddp x2 (predicted)", "pipeline x1", "pipeline x2", "pipeline x2 (predicted)"]
    for name, bar in bars.items():
        parts = bar["parts"]
        step = bar["range"][0] if "predicted" in name else measured[name]["step_seconds"]  # a prediction's bar is its fast end
        assert bar["step"] == step and min(v for v in parts.values() if v is not None) >= 0, (name, bar)
        assert sum(v for v in parts.values() if v is not None) == pytest.approx(step, rel=0.05), (name, parts)
        assert parts["compute"] > 0 and parts["optimizer"] > 0 and parts["data"] > 0, (name, parts)
        assert (parts["bubble"] is None) == name.startswith("ddp"), (name, parts)
    assert bars["ddp x1"]["parts"]["comm"] == 0 and bars["ddp x2"]["parts"]["comm"] == measured["ddp x2"]["comm_seconds"]
    # Every run's loss at every step it logged.
    assert {name: (c["steps"], c["losses"]) for name, c in data["loss"]["curves"].items()} == {
        name: (list(range(1, r["steps"] + 1)), r["losses"]) for name, r in measured.items()}
    assert data["loss"]["baseline"] == "ddp x1"
    assert {b["name"]: b["per_rank"] for b in data["memory"]["bars"] if "predicted" not in b["name"]} == {
        name: r["peak_mem_gib_per_rank"] for name, r in measured.items()}
    comm = {b["name"]: b for b in data["comm"]["bars"]}
    assert comm["ddp x2"]["bytes"]["all_reduce"] > 0 and comm["ddp x2"]["busbw_gbps"] == measured["ddp x2"]["allreduce_busbw_gbps"]
    assert data["speedup"]["measured"]["ddp"] == [(1, 1.0), (2, measured["ddp x2"]["samples_per_sec"] / base)]
    # The failed runs are missing, said so in each picture and the report, and drawn as nothing (not as zero).
    broken = ["broken x1", "broken x2", "broken x2 (predicted)"]
    for key, picture in data.items():
        assert [m["name"] for m in picture["missing"]] == (broken[:2] if key == "loss" else broken), key  # a prediction has no loss
    drawn = [*bars, *data["loss"]["curves"], *(b["name"] for b in data["memory"]["bars"]), *comm, *data["speedup"]["measured"], *data["speedup"]["predicted"]]
    assert not [name for name in drawn if name.startswith("broken")], drawn
    assert all(re.search(rf"^\| {re.escape(name)} \| (failed: )?(rank 0: )?error: broken on purpose", report, re.M) for name in broken), report
    # Without matplotlib: the same report, with the table, saying how to get its pictures.
    monkeypatch.setattr(sweep_report, "_pyplot", lambda: None)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert sweep_report.write_report(bare, *lines, bandwidth, "TABLE", []) == {}
    assert os.listdir(bare) == ["REPORT.md"] and "TABLE" in (bare / "REPORT.md").read_text() and "pip install matplotlib" in (bare / "REPORT.md").read_text()
