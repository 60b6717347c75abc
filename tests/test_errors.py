"""What a script cannot serve it refuses before training, with one line from rank 0 that
says what to change; a NaN loss stops the run naming the step; a silent peer fails the
job within --timeout. Never a hang, never a traceback from every rank."""

import time

import pytest
from harness import run_script

BAD = [
    ("ddp_train.py", ["--global-batch-size", "3"], "--global-batch-size 3 must divide evenly over 2 ranks"),
    ("pipeline_train.py", ["--schedule", "interleaved-1f1b", "--stages-per-rank", "5"], "10 pipeline stages but only 8 blocks"),
    ("pipeline_train.py", ["--schedule", "1f1b", "--micro-batches", "1"], "--schedule 1f1b cannot run 1 micro-batches over 2 stages"),
    ("model_parallel_train.py", ["--split", "3,3"], "--split 3,3 must give every part at least one block and 8 in all"),
    ("hybrid_train.py", ["--pp", "1", "--dp-wrapper", "ddp", "--schedule", "zero-bubble"], "DDP's all-reduce hooks never fire"),
    ("ddp_train.py", ["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]


def error_lines(stderr):
    return [line for line in stderr.splitlines() if "error: " in line and not line.startswith(("E1", "W1", " "))]


@pytest.mark.parametrize("script,args,message", BAD, ids=[f"{s.removesuffix('_train.py')}-{a[-1]}" for s, a, _ in BAD])
def test_bad_configuration_is_refused_once_before_training(script, args, message):
    proc, records = run_script(script, 2, args, timeout=60)
    errors = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "[rank" not in proc.stderr and "step " not in proc.stdout and records == []


def test_nan_loss_stops_the_run_naming_the_step():
    proc, records = run_script("ddp_train.py", 2, ["--steps", "6"], env={"TRAIN_FAULT": "nan:3"}, timeout=60)
    errors = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(errors) == 1 and errors[0].startswith("error: loss is nan at step 3"), proc.stderr[-3000:]
    assert "step     3/" not in proc.stdout and records == []


def test_a_silent_peer_fails_the_job_within_the_timeout():
    start = time.monotonic()
    proc, records = run_script("ddp_train.py", 2, ["--steps", "6", "--timeout", "5"], env={"TRAIN_FAULT": "hang:2:1"}, timeout=90)
    errors = error_lines(proc.stderr)
    assert proc.returncode != 0 and len(errors) == 1 and errors[0].startswith("error: rank 0 lost a peer (Timed out"), proc.stderr[-3000:]
    assert time.monotonic() - start < 45 and records == []
