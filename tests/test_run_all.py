"""run_all.sh's CPU fallback end to end: the table it prints must be the figures its
runs wrote, a failing run must be reported in the table, and the sweep must go on."""

import json
import shutil
import subprocess

from harness import ROOT


def table_rows(path):
    """The data rows of a GitHub-style Markdown table, as lists of cell strings."""
    lines = [line for line in open(path) if line.startswith("|")][2:]  # skip header and rule
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def test_cpu_sweep_reports_what_the_runs_measured(tmp_path):
    for name in ("run_all.sh", "common.py", "ddp_train.py", "pipeline_train.py"):
        shutil.copy(ROOT / name, tmp_path)
    (tmp_path / "broken_train.py").write_text("import sys\nprint('error: broken on purpose', file=sys.stderr)\nsys.exit(2)\n")
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "run_all.sh", "--cpu", "--strategies", "ddp,broken,pipeline", "--gpus", "1,2",
                           "--steps", "3", "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "CPU fallback" in proc.stdout.splitlines()[0]
    assert "[1/6] ddp x1 ... " in proc.stdout and "[6/6] pipeline x2 ... " in proc.stdout
    assert "[3/6] broken x1 ... FAILED" in proc.stdout and "(log: " in proc.stdout

    records = {(r["strategy"], r["world_size"]): r for r in map(json.loads, open(out / "results.jsonl"))}
    assert set(records) == {("ddp", 1), ("ddp", 2), ("pipeline", 1), ("pipeline", 2)}
    base = records["ddp", 1]["samples_per_sec"]
    rows = table_rows(out / "table.md")
    # Article order: baseline, data parallel, pipeline; then strategies it does not have.
    assert [(row[0], row[1]) for row in rows] == [("single-GPU baseline", "1"), ("ddp", "2"), ("pipeline", "1"),
                                                  ("pipeline", "2"), ("broken", "1"), ("broken", "2")]
    for row in rows[:4]:
        strategy = "ddp" if row[0] == "single-GPU baseline" else row[0]
        r = records[strategy, int(row[1])]
        speedup = r["samples_per_sec"] / base
        overhead = f"comm {r['comm_pct']:.1f}" if strategy == "ddp" and r["world_size"] > 1 else (
            f"bubble {r['bubble_pct']:.1f}" if strategy == "pipeline" else "-")
        assert row[2:] == [str(r["global_batch_size"]), f"{r['samples_per_sec']:.2f}", f"{speedup:.2f}x",
                           f"{100 * speedup / r['world_size']:.0f}%", "-", f"{r['peak_mem_gib']:.2f} ({r['mem_pct']:.0f}%)", overhead]
    # Weak scaling: the data-parallel row doubles the batch, the pipeline keeps it.
    assert records["ddp", 2]["global_batch_size"] == 16 and records["pipeline", 2]["global_batch_size"] == 8
    assert rows[4][3] == "failed: error: broken on purpose"
