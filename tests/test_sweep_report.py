"""sweep_report.py on its own: the table's maths and the verdict on made-up lines, every
input checked (a damaged line named and left out, a bad folder or flag refused in one
line), and the sweep's plan (which runs, on which batch, with which settings)."""

import json
import math
import os
import random
import re
import threading

import pytest

import common
import sweep_report
from sweep import pictures
from sweep.lines import FAILURE_FIELDS, KINDS, RUN_FIELDS, SIMULATED_BY_STRATEGY, InputError, load
from sweep.plan import BUBBLE_TARGET_PCT, CPU_FLOPS, plan
from sweep.predict import link_bandwidth, roles, step_split
from sweep.settings import candidate_predictions, predictions, render_flags


def record(strategy, world_size, samples_per_sec, global_batch_size=8, **extra):
    """A results line as the scripts write it, with the fields the report reads."""
    config = {"grad_accum": 1, **extra.pop("config", {})}
    return {"strategy": strategy, "world_size": world_size, "global_batch_size": global_batch_size, "samples_per_sec": samples_per_sec,
            "step_seconds": global_batch_size / samples_per_sec, "mfu": None, "peak_mem_gib": 1.0, "mem_pct": 10.0, "comm_pct": None,
            "model": "tiny", "params": 1000, "seq_len": 64, "losses": [2.0, 1.0], "start_step": 0, "gpu_name": None, "torch_version": "x",
            "config": config, **extra}


def pipeline_config(schedule="1f1b", micro_batches=4, stages_per_rank=1, **extra):
    return {"schedule": schedule, "micro_batches": micro_batches, "stages_per_rank": stages_per_rank, **extra}


def failure(script, world_size, global_batch_size=8, error="error: out of memory", **extra):
    """A failures line as run_all.sh writes it: the script's name, not the record's."""
    return {"strategy": script, "world_size": world_size, "global_batch_size": global_batch_size, "error": error, "log": "x.log", **extra}


def simulated(strategy, world_size, rank, step_seconds, global_batch_size=8, **extra):
    """A simulated rank's line: DDP-like ranks communicate nothing here, so the prediction is its step."""
    return record(strategy, world_size, global_batch_size / step_seconds, global_batch_size, simulated_rank=rank, comm_per_step=[],
                  **({"mesh": {"dp": 1, "tp": world_size}} if strategy == "tp" else {}), **extra)


def write(folder, records=(), failures=(), sims=()):
    for name, lines in (("results.jsonl", records), ("failures.jsonl", failures), ("simulated.jsonl", sims)):
        (folder / name).write_text("".join(json.dumps(line) + "\n" for line in lines))


def rows_of(tmp_path, records, failures=()):
    """The table sweep_report makes of these lines, as {(strategy, GPUs): row}, and its row order."""
    write(tmp_path, records, failures)
    rows = sweep_report.table_rows(*load(tmp_path)[:4])
    return {(row[0], int(row[1])): row for row in rows}, [(row[0], int(row[1])) for row in rows]


def test_the_baseline_is_ddp_at_one_gpu_wherever_it_sits(tmp_path):
    rows, _ = rows_of(tmp_path, [record("pipeline", 1, 50.0, config=pipeline_config()), record("ddp", 2, 150.0, 16), record("tp", 2, 40.0),
                                 record("ddp", 1, 100.0)])
    # Speedup and efficiency against ddp x1's 100 samples/s, not the pipeline's 50.
    assert [rows[key][4:6] for key in [("single-GPU baseline", 1), ("ddp", 2), ("pipeline", 1), ("tp", 2)]] == [
        ["1.00x", "100%"], ["1.50x", "75%"], ["0.50x", "50%"], ["0.40x", "20%"]]


def test_without_a_baseline_there_is_no_speedup(tmp_path):
    rows, _ = rows_of(tmp_path, [record("fsdp", 1, 50.0), record("ddp", 2, 150.0, 16)])
    assert [row[4:6] for row in rows.values()] == [["-", "-"], ["-", "-"]]
    # A baseline that failed is no baseline either.
    rows, _ = rows_of(tmp_path, [record("ddp", 2, 150.0, 16)], [failure("ddp", 1)])
    assert rows["single-GPU baseline", 1][3:6] == ["failed: error: out of memory", "-", "-"] and rows["ddp", 2][4:6] == ["-", "-"]


def test_a_run_that_appears_twice_shows_once_by_its_newest_line(tmp_path):
    rows, order = rows_of(tmp_path, [record("ddp", 1, 100.0), record("ddp", 2, 180.0, 16), record("ddp", 2, 120.0, 16)])
    assert order == [("single-GPU baseline", 1), ("ddp", 2)]
    assert rows["ddp", 2][3:5] == ["120.00", "1.20x"]


@pytest.mark.parametrize("script, name", [("fsdp", "fsdp"), ("tensor_parallel", "tp"), ("context_parallel", "cp")])
def test_a_run_that_wrote_its_figures_then_failed_shows_once_as_failed(tmp_path, script, name):
    # Its record names the strategy as its script's records do; run_all.sh's failure line names the script.
    rows, order = rows_of(tmp_path, [record("ddp", 1, 100.0), record(name, 2, 90.0, 16)], [failure(script, 2, 16, flags="")])
    assert order == [("single-GPU baseline", 1), (name, 2)]
    assert rows[name, 2][3:10] == ["failed: error: out of memory", "-", "-", "-", "-", "-", "-"]


def test_rows_come_in_the_articles_order_whatever_the_input_order(tmp_path):
    records = [record("zeta", 1, 1.0), record("tp", 2, 1.0), record("fsdp", 2, 1.0, 16), record("alpha", 2, 1.0), record("cp", 1, 1.0),
               record("hybrid", 2, 1.0, 8, config=pipeline_config(pp=2)), record("ddp", 2, 1.0, 16), record("pipeline", 2, 1.0, config=pipeline_config()),
               record("model_parallel", 2, 1.0), record("ddp", 1, 1.0), record("alpha", 1, 1.0)]
    _, order = rows_of(tmp_path, records, [failure("tensor_parallel", 1), failure("model_parallel", 1)])
    assert order == [("single-GPU baseline", 1), ("ddp", 2), ("model_parallel", 1), ("model_parallel", 2), ("pipeline", 2), ("hybrid", 2),
                     ("fsdp", 2), ("tp", 1), ("tp", 2), ("cp", 1), ("alpha", 1), ("alpha", 2), ("zeta", 1)]


def test_a_step_splits_into_what_its_results_line_measured():
    parts = {"data": 1.0, "to_optimizer": 7.0, "optimizer": 2.0}
    # DDP measured 3 s of exposed communication apart: compute is the rest of the span.
    split = step_split(record("ddp", 2, 1.0, step_seconds=10.0, step_parts_seconds=parts, comm_seconds=3.0))
    assert split == {"data": 1.0, "compute": 3.0, "comm": 3.0, "bubble": None, "optimizer": 2.0, "rest": 1.0}
    # One GPU communicates nothing; elsewhere unmeasured communication is no figure (it sits in compute).
    assert step_split(record("ddp", 1, 1.0, step_seconds=10.0, step_parts_seconds=parts))["comm"] == 0.0
    assert step_split(record("fsdp", 2, 1.0, step_seconds=10.0, step_parts_seconds=parts))["compute"] == 6.0
    # A pipeline's ranks were busy 40% of the step, 2 s of it in the optimizer: the span's other 4 s are the bubble.
    split = step_split(record("pipeline", 2, 1.0, step_seconds=10.0, step_parts_seconds=parts, utilisation_pct=40.0))
    assert split == {"data": 1.0, "compute": 2.0, "comm": None, "bubble": 4.0, "optimizer": 2.0, "rest": 1.0}
    assert step_split(record("tp", 2, 1.0, step_seconds=10.0)) is None  # a line from before the split


def test_a_sweep_folder_copied_off_its_machine_still_links_its_profiles(tmp_path, monkeypatch):
    # A GPU box's sweep, copied here: its lines name the folders it profiled into over there.
    (tmp_path / "profiles" / "ddp_x1").mkdir(parents=True)
    (tmp_path / "profiles" / "ddp_x1" / "ops_rank0.txt").write_text("aten::mm\n")
    write(tmp_path, [record("ddp", 1, 1.0, config={"profile": "/root/out/sweep/profiles/ddp_x1"})])
    monkeypatch.setattr(pictures, "_pyplot", lambda: None)
    sweep_report.write_report(tmp_path, *load(tmp_path)[:4], (*link_bandwidth(None)[:2], 8), "TABLE", [])
    assert "| ddp x1 | not here | [ops_rank0.txt](profiles/ddp_x1/ops_rank0.txt) |" in (tmp_path / "REPORT.md").read_text()


def test_a_float8_run_is_a_row_of_its_own_after_its_strategy(tmp_path):
    float8 = record("ddp", 1, 150.0, config={"float8": "tensorwise"})
    rows, order = rows_of(tmp_path, [float8, record("fsdp", 1, 90.0), record("ddp", 1, 100.0)], [{**failure("fsdp", 1), "float8": "rowwise"}])
    assert order == [("single-GPU baseline", 1), ("ddp float8 tensorwise", 1), ("fsdp", 1), ("fsdp float8 rowwise", 1)]
    # Against the bf16 baseline, not its own.
    assert rows["ddp float8 tensorwise", 1][4] == "1.50x" and rows["fsdp float8 rowwise", 1][3].startswith("failed")


def test_the_flags_a_run_used_are_its_rows_and_a_setting_that_ran_out_of_memory_yields_to_one_that_ran(tmp_path):
    chosen = pipeline_config("interleaved-1f1b", 16, 2, activation_checkpointing=True)
    rows, _ = rows_of(tmp_path, [record("ddp", 1, 10.0), record("pipeline", 4, 30.0, 32, config=chosen),
                                 record("tp", 2, 20.0, 16, config={"sequence_parallel": True, "dp": 1})],
                      [failure("pipeline", 4, 32, flags="--schedule interleaved-1f1b --micro-batches 16 --stages-per-rank 2")])
    assert rows["pipeline", 4][3] == "30.00"
    assert rows["pipeline", 4][-1] == "--schedule interleaved-1f1b --micro-batches 16 --stages-per-rank 2 --activation-checkpointing"
    assert rows["tp", 2][-1] == "--sequence-parallel"


# ----------------------------------------------------------------------------
# Predictions: the settings tried, the fastest shown, and the verdict
# ----------------------------------------------------------------------------


def pipeline_rank(world_size, rank, config, action, batch=8):
    """A simulated pipeline rank whose stages each take `action` s a forward and twice that a backward."""
    pp = world_size
    per_rank, m = config["stages_per_rank"], config["micro_batches"]
    orders = {str(r): [f"F{r + k * pp}:{i}" for k in range(per_rank) for i in range(m)]
              + [f"B{r + k * pp}:{i}" for k in reversed(range(per_rank)) for i in range(m)] for r in range(pp)}
    step = len(orders["0"]) * 1.5 * action + 0.01
    return record("pipeline", world_size, batch / step, batch, simulated_rank=rank, comm_per_step=[], pipeline_order=orders,
                  action_seconds={"F": action, "B": 2 * action, "optimizer": 0.001}, config={"grad_accum": 1, **config})


def test_the_fastest_settings_tried_is_the_predicted_row_and_best_names_its_flags(tmp_path, capsys):
    interleaved, plain = pipeline_config("interleaved-1f1b", 4, 2), pipeline_config("1f1b", 8, 1)
    for slow, fast in ((interleaved, plain), (plain, interleaved)):
        sims = [pipeline_rank(2, r, slow, 0.5) for r in (0, 1)] + [pipeline_rank(2, r, fast, 0.01) for r in (0, 1)]
        write(tmp_path, [record("ddp", 1, 10.0)], sims=sims)
        rows = {row[0]: row for row in sweep_report.table_rows(*load(tmp_path)[:4], bandwidth=(460, 35, 8))}
        flags = render_flags("pipeline", fast)
        assert rows["pipeline (predicted)"][-1] == flags
        assert sweep_report.main(["--best", str(tmp_path), "pipeline", "2", "8"]) == 0
        assert capsys.readouterr().out.strip() == flags


def test_settings_with_a_rank_missing_or_failed_are_not_chosen(tmp_path):
    interleaved, plain = pipeline_config("interleaved-1f1b", 4, 2), pipeline_config("1f1b", 8, 1)
    # The faster settings lost rank 1 (an interrupted sweep); then it failed outright.
    write(tmp_path, sims=[pipeline_rank(2, 0, interleaved, 0.01)] + [pipeline_rank(2, r, plain, 0.5) for r in (0, 1)])
    by_flags = candidate_predictions(*load(tmp_path)[2:4], (460, 35, 8))[("pipeline", 2, 8)]
    assert "rank 1 not simulated" in by_flags[render_flags("pipeline", interleaved)]["error"]
    assert predictions(*load(tmp_path)[2:4], (460, 35, 8))[("pipeline", 2, 8)]["flags"] == render_flags("pipeline", plain)
    write(tmp_path, failures=[failure("pipeline", 2, simulated=True, simulated_rank=1, flags=render_flags("pipeline", plain))],
          sims=[pipeline_rank(2, r, plain, 0.5) for r in (0, 1)])
    assert "error" in predictions(*load(tmp_path)[2:4], (460, 35, 8))[("pipeline", 2, 8)]


def test_the_verdict_ranks_each_count_by_samples_per_second(tmp_path):
    rates = [("fsdp", 70.0), ("ddp", 90.0), ("cp", 30.0), ("tp", 50.0), ("model_parallel", 10.0)]
    random.Random(0).shuffle(rates)
    records = [record("ddp", 1, 10.0)] + [record(name, 4, rate, 32) for name, rate in rates]
    write(tmp_path, records, [failure("pipeline", 4, 32), failure("hybrid", 4, 32, error="error: broken")],
          sims=[simulated(name, 8, 0, step, 64) for name, step in (("ddp", 0.5), ("fsdp", 0.25), ("tp", 2.0))]
          + [simulated("cp", 8, 0, 1.0, 64, mem_pct=150.0)])
    jobs = {job["count"]: job for job in sweep_report.ranking(*load(tmp_path)[:4], (460, 35, 8))}
    assert jobs[4]["source"] == "measured" and jobs[8]["source"] == "predicted"
    assert [name for name, *_ in jobs[4]["ranked"]] == [name for name, _ in sorted(rates, key=lambda r: -r[1])]
    assert [name for name, *_ in jobs[8]["ranked"]] == ["fsdp", "ddp", "tp"]
    assert [rate for _, rate, *_ in jobs[8]["ranked"]] == [64 / 0.25, 64 / 0.5, 64 / 2.0]
    assert [name for name, _ in jobs[4]["does_not_fit"]] == ["pipeline"] and [name for name, _ in jobs[4]["failed"]] == ["hybrid"]
    assert [name for name, _ in jobs[8]["does_not_fit"]] == ["cp"]
    lines = sweep_report.verdict_lines(*load(tmp_path)[:4], (460, 35, 8))
    assert lines[-1].startswith("8 processes, tiny, global batch 64 (predicted): fsdp 256.00 samples/s (25.60x, 1.00 GiB), ddp")
    assert "does not fit: cp (needs 1.0 GiB, 150% of the device)" in lines[-1]
    # GPUs where the lines come from GPUs.
    write(tmp_path, [{**record("ddp", 2, 10.0, 16), "gpu_name": "NVIDIA H100"}])
    assert sweep_report.verdict_lines(*load(tmp_path)[:4])[0].startswith("2 GPUs, tiny, global batch 16 (measured): ddp")


def test_the_report_and_table_end_with_the_verdict_and_count_processes_on_cpu_and_gpus_on_gpus(tmp_path, capsys):
    records = [record("ddp", 1, 10.0), record("fsdp", 2, 30.0, 16), record("ddp", 2, 20.0, 16)]
    write(tmp_path, records)
    assert sweep_report.main([str(tmp_path)]) == 0
    verdict = "2 processes, tiny, global batch 16 (measured): fsdp 30.00 samples/s (3.00x, 1.00 GiB), ddp 20.00 samples/s (2.00x, 1.00 GiB)"
    assert (tmp_path / "table.md").read_text().rstrip().endswith(verdict)
    assert (tmp_path / "REPORT.md").read_text().rstrip().endswith(verdict)
    assert verdict in capsys.readouterr().out
    assert (tmp_path / "table.md").read_text().startswith("| strategy            | processes ")
    assert pictures.figures(*load(tmp_path)[:4])["speedup"]["gpus"] is False
    write(tmp_path, [{**r, "gpu_name": "NVIDIA H100 80GB HBM3"} for r in records])
    assert sweep_report.main([str(tmp_path)]) == 0
    assert (tmp_path / "table.md").read_text().startswith("| strategy            | GPUs ")
    assert (tmp_path / "table.md").read_text().rstrip().endswith(verdict.replace("processes", "GPUs"))
    assert pictures.figures(*load(tmp_path)[:4])["speedup"]["gpus"] is True


# ----------------------------------------------------------------------------
# Every input checked: one line, a non-zero exit, nothing lost
# ----------------------------------------------------------------------------


def report(argv, capsys):
    """(exit status, stdout, stderr lines) of sweep_report.main(argv), a usage error's included."""
    try:
        code = sweep_report.main(argv)
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def sweep_folder(tmp_path):
    folder = tmp_path / "sweep"
    folder.mkdir()
    pipeline = pipeline_config("1f1b", 2)
    write(folder, [record("ddp", 1, 10.0), record("ddp", 2, 18.0, 16), record("pipeline", 2, 12.0, 16, config=pipeline)],
          [failure("fsdp", 2, 16, flags="")], [simulated("ddp", 4, 0, 1.0, 32), pipeline_rank(2, 0, pipeline, 0.01, 16),
                                                pipeline_rank(2, 1, pipeline, 0.01, 16)])
    return folder


BAD_ARGUMENTS = [
    ([], "name the sweep's results folder"),
    (["{tmp}/missing"], "no such folder"),
    (["{tmp}/sweep/results.jsonl"], "is not a folder"),
    ([""], "name the sweep's results folder"),
    (["{tmp}/fifo"], "fifo/results.jsonl is not a file of results lines"),
    (["{tmp}/sweep", "--intra-gbps", "-5"], "--intra-gbps: '-5' is not a finite number above 0"),
    (["{tmp}/sweep", "--intra-gbps", "0"], "--intra-gbps: '0' is not a finite number above 0"),
    (["{tmp}/sweep", "--inter-gbps", "nan"], "--inter-gbps: 'nan' is not a finite number above 0"),
    (["{tmp}/sweep", "--inter-gbps", "inf"], "'inf' is not a finite number above 0"),
    (["{tmp}/sweep", "--intra-gbps", "fast"], "'fast' is not a finite number above 0"),
    (["{tmp}/sweep", "--gpus-per-node", "0"], "--gpus-per-node: '0' is not a whole number of at least 1"),
    (["{tmp}/sweep", "--gpus-per-node", "2.5"], "'2.5' is not a whole number of at least 1"),
    (["{tmp}/sweep", "--gpus-per-node"], "expected one argument"),
    (["{tmp}/sweep", "--wat"], "unrecognized arguments: --wat"),
    (["{tmp}/sweep", "{tmp}/other"], "unrecognized arguments"),
    (["{tmp}/sweep", "--into", "{tmp}/sweep/results.jsonl"], "is not a folder"),
    (["{tmp}/sweep", "--into", "{tmp}/sweep/results.jsonl/deeper"], "cannot be made"),
    (["{tmp}/empty"], "holds no usable results line"),
    (["--plan", "{{", "{tmp}/sweep"], "--plan takes no folder"),
    (["--plan", "{{"], "--plan: not JSON"),
    (["--plan", "[]"], "--plan: 'model' missing"),
    (["--best", "{tmp}/sweep", "ddp", "four", "8"], "N and BATCH must be whole numbers"),
    (["--best", "{tmp}/missing", "ddp", "4", "32"], "no such folder"),
]


@pytest.mark.parametrize("argv, cause", BAD_ARGUMENTS, ids=[" ".join(a) or "no argument" for a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_refused_in_one_line(tmp_path, capsys, argv, cause):
    folder = sweep_folder(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "results.jsonl")  # a read would wait for a writer forever
    before = {p: p.read_bytes() for p in folder.iterdir()}
    code, out, err = report([a.format(tmp=tmp_path) for a in argv], capsys)
    assert code == 2 and len(err) == 1 and cause in err[0] and err[0].startswith("sweep_report.py: "), (code, err)
    assert "Traceback" not in out and {p: p.read_bytes() for p in folder.iterdir()} == before


def test_a_folder_that_cannot_be_read_or_written_is_named_with_what_to_do(tmp_path, capsys, monkeypatch):
    folder = sweep_folder(tmp_path)
    # A report file that cannot be written (a folder in its place): the hint says where else.
    (folder / "table.md").mkdir()
    code, _, err = report([str(folder)], capsys)
    assert code == 2 and len(err) == 1 and "--into DIR" in err[0] and "table.md" in err[0], err
    assert report([str(folder), "--into", str(tmp_path / "docs")], capsys)[0] == 0
    assert (tmp_path / "docs" / "REPORT.md").exists() and (tmp_path / "docs" / "results.jsonl").read_bytes() == (folder / "results.jsonl").read_bytes()
    # A folder this user may not write (permissions do not bind root, so the check is told so).
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: access(path, mode) and not (str(path) == str(folder) and mode & os.W_OK))
    code, _, err = report([str(folder)], capsys)
    assert code == 2 and len(err) == 1 and err[0].endswith(f"{folder} is not writable: write the table and report elsewhere with --into DIR"), err
    monkeypatch.undo()
    # A results file that cannot be read: a link to itself, and a folder in its place.
    (folder / "results.jsonl").unlink()
    (folder / "results.jsonl").symlink_to("results.jsonl")
    code, _, err = report([str(folder), "--into", str(tmp_path / "docs")], capsys)
    assert code == 2 and len(err) == 1 and err[0].endswith("results.jsonl cannot be read: Too many levels of symbolic links"), err
    (folder / "results.jsonl").unlink()
    (folder / "results.jsonl").mkdir()
    code, _, err = report([str(folder), "--into", str(tmp_path / "docs")], capsys)
    assert code == 2 and len(err) == 1 and err[0].endswith("results.jsonl is not a file of results lines"), err


def test_an_output_that_would_wait_vanish_or_replace_lines_is_refused_before_anything_is_written(tmp_path, capsys):
    folder = sweep_folder(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    # A FIFO in place of REPORT.md: opening it to write would wait for a reader forever (a
    # reader opens it after 10 s, so that a missing check fails the test instead of hanging
    # it). A link to /dev/null in place of a picture: the picture would vanish.
    os.mkfifo(folder / "REPORT.md")
    (folder / pictures.PICTURES["loss"]).symlink_to(os.devnull)
    unblock = threading.Timer(10, lambda: os.close(os.open(folder / "REPORT.md", os.O_RDONLY | os.O_NONBLOCK)))
    unblock.start()
    try:
        for name in ("REPORT.md", pictures.PICTURES["loss"]):
            code, _, err = report([str(folder)], capsys)
            assert code == 2 and len(err) == 1 and err[0].endswith(f"{folder / name} is not a regular file; write them elsewhere with --into DIR"), err
            (folder / name).unlink()
    finally:
        unblock.cancel()
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # the table was not written either
    # --into a folder that holds another sweep's lines: they may be its only copy.
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "simulated.jsonl").write_text("another sweep's\n")
    code, _, err = report([str(folder), "--into", str(docs)], capsys)
    assert code == 2 and len(err) == 1 and f"--into {docs} holds a simulated.jsonl that is not {folder}'s" in err[0], err
    assert os.listdir(docs) == ["simulated.jsonl"] and (docs / "simulated.jsonl").read_text() == "another sweep's\n"
    # Copies of this sweep's own lines are what --into keeps: a rebuild into the same folder goes on.
    (docs / "simulated.jsonl").unlink()
    assert report([str(folder), "--into", str(docs)], capsys)[0] == 0
    assert report([str(folder), "--into", str(docs)], capsys)[0] == 0


def damaged_lines(line):
    """Each way one results line can be damaged: cut short, garbage bytes, not an object,
    each field it needs missing or of a wrong type, nested parts broken."""
    text = json.dumps(line).encode()
    yield "cut short", text[: len(text) // 2]
    yield "garbage bytes", b"\xff\xfe\x00garbage\x81"
    yield "not an object", b"[1, 2, 3]"
    yield "deeply nested", b"[" * 100000 + b"]" * 100000
    for name in RUN_FIELDS:
        yield f"no {name}", json.dumps({k: v for k, v in line.items() if k != name}).encode()
        for wrong in ("text", -1, 0, None, [], {}, True, 1e400):
            kind = RUN_FIELDS[name]
            ok, _ = KINDS[kind.rstrip("?")]
            if not ok(wrong) and not (wrong is None and kind.endswith("?")):
                yield f"{name} = {wrong!r}", json.dumps({**line, name: wrong}).replace("Infinity", "1e400").encode()
    for name, wrong in (("comm_per_step", [{"kind": "send", "group": [0, 1], "group_size": 2, "bytes": 8, "calls": 0}]),
                        ("step_parts_seconds", {"data": 1.0}), ("peak_mem_gib_per_rank", ["x"]), ("mesh", {"tp": 0})):
        yield f"{name} = {wrong!r}", json.dumps({**line, name: wrong}).encode()
    yield "config.micro_batches = 0", json.dumps({**line, "config": {**line["config"], "micro_batches": 0}}).encode()


@pytest.mark.parametrize("file", ["results.jsonl", "simulated.jsonl", "failures.jsonl"])
def test_every_kind_of_damaged_line_is_named_and_left_out_and_the_rest_reported(tmp_path, capsys, monkeypatch, file):
    monkeypatch.setattr(pictures, "_pyplot", lambda: None)  # the pictures are not the point, and each case would draw five
    folder = sweep_folder(tmp_path)
    good = json.loads((folder / file).read_text().splitlines()[-1])
    if file == "failures.jsonl":  # its own fields
        cases = [("cut short", json.dumps(good)[:20].encode()), ("garbage", b"\x80\x81"), *[
            (f"{name} = {wrong!r}", json.dumps({**good, name: wrong}).encode())
            for name in FAILURE_FIELDS for wrong in (None, 5, "", [])
            if not KINDS[FAILURE_FIELDS[name]][0](wrong)]]
    else:
        cases = list(damaged_lines(good))
    if file == "simulated.jsonl":  # what a prediction reads besides: its rank, its bytes, its schedule
        for name in ("simulated_rank", "comm_per_step", *SIMULATED_BY_STRATEGY["pipeline"]):
            cases += [(f"no {name}", json.dumps({k: v for k, v in good.items() if k != name}).encode()),
                      (f"{name} = 'x'", json.dumps({**good, name: "x"}).encode())]
        cases += [("rank past the world", json.dumps({**good, "simulated_rank": good["world_size"]}).encode()),
                  ("a model that is no preset", json.dumps({**good, "model": "huge"}).encode()),
                  ("an action that is none", json.dumps({**good, "pipeline_order": {"0": ["X0:0"]}}).encode())]
    intact = (folder / file).read_bytes()
    for what, damaged in cases:
        (folder / file).write_bytes(intact + damaged + b"\n" + intact)
        number = intact.count(b"\n") + 1
        code, out, err = report([str(folder)], capsys)
        assert code == 1, (what, code, err)
        assert err[0].startswith(f"sweep_report.py: {folder / file}:{number}: ") and "left out" in err[0], (what, err)
        assert len(err) == 2 and "1 damaged line left out" in err[1], (what, err)
        assert "Traceback" not in out and (folder / "REPORT.md").exists() and f"{file}:{number}" in (folder / "REPORT.md").read_text(), what
        assert (folder / file).read_bytes() == intact + damaged + b"\n" + intact  # the file keeps it
        (folder / "REPORT.md").unlink()


def test_simulated_lines_that_contradict_each_other_are_a_row_that_says_so(tmp_path, capsys):
    pipeline = pipeline_config("1f1b", 2)
    # Rank 1 waits for a micro-batch rank 0 never sends: the replay cannot finish.
    first = {**pipeline_rank(2, 0, pipeline, 0.01), "pipeline_order": {"0": ["F0:0"], "1": ["F1:5", "B1:5"]}}
    write(tmp_path, [record("ddp", 1, 10.0)], sims=[first, pipeline_rank(2, 1, pipeline, 0.01)])
    code, out, err = report([str(tmp_path)], capsys)
    assert code == 0 and err == [], err
    assert re.search(r"pipeline \(predicted\) +2 +8 +rank 0: its lines cannot be replayed \(ValueError", out), out


def test_an_empty_sweep_or_one_of_damaged_lines_is_an_error_not_an_empty_report(tmp_path, capsys):
    write(tmp_path)
    code, _, err = report([str(tmp_path)], capsys)
    assert code == 2 and len(err) == 1 and "holds no usable results line" in err[0] and not (tmp_path / "REPORT.md").exists()
    (tmp_path / "results.jsonl").write_bytes(b"{\"strategy\": \n\x00\x01\n")
    code, _, err = report([str(tmp_path)], capsys)
    assert code == 2 and err[-1].endswith("(2 damaged, named above)") and len(err) == 3, err


# ----------------------------------------------------------------------------
# The plan: one job per count, each strategy at its best settings for it
# ----------------------------------------------------------------------------

ALL = ["ddp", "model_parallel", "pipeline", "hybrid", "fsdp", "tensor_parallel", "context_parallel"]


def spec(**changes):
    return {"model": "2.5b", "strategies": ALL, "gpus": [1], "simulate": [2, 4, 8], "batch": 8, "strong": False, "device": "cuda",
            "steps": 20, "seq_len": 1024, "float8": None, **changes}


def bubble_pct(pp, per_rank, m):
    return 100 * (pp - 1) / (per_rank * m + pp - 1)


@pytest.mark.parametrize("changes", [{}, {"strong": True}, {"batch": 3, "gpus": [1, 2], "simulate": [4, 6], "model": "tiny", "seq_len": 64},
                                     {"batch": 1, "strong": True, "model": "tiny", "seq_len": 48, "simulate": [2, 3, 4]}])
def test_every_strategy_at_a_count_trains_the_same_batch_and_pipelines_take_enough_micro_batches(changes):
    s = spec(**changes)
    cfg = common.PRESETS[s["model"]]
    rows = plan(s)
    for n in {*s["gpus"], *s["simulate"]}:
        at_n = [r for r in rows if r["n"] == n and "skip" not in r]
        assert {r["batch"] for r in at_n} == {s["batch"] * (1 if s["strong"] else n)}, n
    for r in rows:
        if "skip" in r or r["script"] not in ("pipeline", "hybrid"):
            continue
        for flags in r["settings"]:
            words = flags.split()
            pp = int(words[words.index("--pp") + 1]) if "--pp" in words else r["n"]
            m = int(words[words.index("--micro-batches") + 1])
            per_rank = int(words[words.index("--stages-per-rank") + 1]) if "--stages-per-rank" in words else 1
            per_pipeline = r["batch"] // (r["n"] // pp)
            fits = [k for k in range(pp, per_pipeline + 1) if per_pipeline % k == 0]
            # The fewest that split the pipeline's batch and bring the ideal bubble to 10%, else one sample each.
            small = [k for k in fits if bubble_pct(pp, per_rank, k) <= BUBBLE_TARGET_PCT]
            assert m == (small[0] if small else fits[-1]), (r, flags)
            assert pp * per_rank <= cfg.n_layers


def test_the_plan_tries_the_settings_that_are_not_obvious_and_chooses_only_where_it_simulated():
    rows = plan(spec(gpus=[1, 2, 4], simulate=[2, 4]))
    tried = [r["settings"][0] for r in rows if (r["script"], r["n"], r["mode"]) == ("pipeline", 4, "simulated")]
    assert tried == ["--schedule interleaved-1f1b --micro-batches 16 --stages-per-rank 2", "--schedule 1f1b --micro-batches 32"]
    measured = {(r["script"], r["n"]): r["settings"] for r in rows if r["mode"] == "measured" and "skip" not in r}
    assert measured["pipeline", 4] == tried
    tried = [r["settings"][0] for r in rows if (r["script"], r["n"], r["mode"]) == ("tensor_parallel", 2, "simulated")]
    assert tried == ["--sequence-parallel", ""]
    choose = {(r["script"], r["n"]): r["choose"] for r in rows if r["mode"] == "measured" and "skip" not in r}
    assert choose["pipeline", 4] and choose["tensor_parallel", 2] and not choose["ddp", 4] and not choose["pipeline", 1]
    # Each simulated row runs the ranks its settings make distinct: a pipeline's ends and one middle.
    ranks = {(r["script"], r["n"], r["settings"][0]): r["ranks"] for r in rows if r["mode"] == "simulated" and "skip" not in r}
    assert ranks["pipeline", 4, "--schedule 1f1b --micro-batches 32"] == [0, 1, 3]
    assert ranks["hybrid", 4, "--pp 2 --schedule 1f1b --micro-batches 16"] == [0, 2]


def test_roles_follow_where_the_schedule_places_stages():
    # Interleaved over 4 ranks, 2 stages each, 8 blocks: rank 0 holds the embedding, rank 3 the head.
    assert roles("pipeline", 4, 8, "interleaved-1f1b", 2) == {0: [0], 1: [1, 2], 3: [3]}
    # The V: rank 0 holds the first and the last stage; the others alike.
    assert roles("pipeline", 4, 8, "zbv", 2) == {0: [0], 1: [1, 2, 3]}
    assert roles("hybrid", 8, 8, "1f1b", 1, pp=2) == {0: [0, 1, 2, 3], 4: [4, 5, 6, 7]}
    assert roles("fsdp", 4, 8) == {0: [0, 1, 2, 3]}


def test_a_plan_with_nothing_to_run_is_refused_with_each_reason():
    with pytest.raises(InputError) as refused:
        plan(spec(strategies=["ddp", "hybrid"], gpus=[2], simulate=[3], batch=1, strong=True))
    assert str(refused.value) == ("nothing to run: ddp x3 global batch 1 does not split over 3 ranks; ddp x2 global batch 1 does not split "
                                  "over 2 ranks; hybrid x3 needs an even number of ranks, 2 pipeline stages x data parallel; "
                                  "hybrid x2 1 samples per pipeline cannot make a micro-batch for each of its 2 stages")


def test_a_cpu_run_that_takes_minutes_says_so():
    rows = plan(spec(device="cpu", model="350m", gpus=[1], simulate=[], strategies=["ddp"]))
    minutes = float(rows[0]["note"].split()[2])
    cfg = common.PRESETS["350m"]
    assert minutes == round(20 * common.flops_per_token(cfg, 1024) * 8 * 1024 / CPU_FLOPS / 60)
    assert plan(spec(device="cpu", model="tiny", seq_len=64, gpus=[1], simulate=[], strategies=["ddp"]))[0]["note"] == ""


def test_huge_batches_plan_at_once():
    rows = plan(spec(batch=999_999_937, strategies=["pipeline"], gpus=[1], simulate=[2]))  # a prime
    assert all(math.isfinite(r["batch"]) for r in rows if "skip" not in r)
