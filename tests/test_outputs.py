"""Every output a script writes is opened, or its failure said in one line, before or
where it happens, never after training as a traceback; options that would silently
measure or do nothing are refused (issue 40's last gaps in the scripts)."""

import os
from dataclasses import replace

import pytest

import common
from harness import TINY, run_script
from test_errors import error_lines, refuse_in_process


def one_line_refusal(script, args, nproc=1, code=2):
    proc, records = run_script(script, nproc, args, torchrun=nproc > 1, forked=True)
    errors = error_lines(proc.stderr)
    assert proc.returncode == code and len(errors) == 1 and records == [], proc.stderr[-3000:]
    assert "step " not in proc.stdout, "refused only after training started"
    return errors[0]


def test_a_results_file_that_cannot_take_the_line_is_refused_before_training(tmp_path, capsys, monkeypatch):
    # /proc files pass os.access for root, yet refuse an append; a FIFO would block the open forever.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, message in (("/proc/self/status", "cannot be appended to"), (fifo, "is not a regular file")):
        code, lines = refuse_in_process("ddp_train.py", ["--results", str(path)], capsys, monkeypatch)
        assert code == 2 and lines == [f"error: --results {path} {message}" + lines[0].split(message)[-1]], lines


def test_a_model_beyond_the_hosts_memory_is_refused_before_it_is_built():
    error = one_line_refusal("fsdp_train.py", ["--vocab-size", 10**12], nproc=2)
    gib = 4 * common.count_params(replace(common.PRESETS["tiny"], vocab_size=10**12)) / 2**30
    assert f"needs {gib:.4g} GiB for its fp32 weights here, more than this host's" in error, error


def test_a_profile_that_cannot_be_written_fails_the_run_in_one_line(tmp_path):
    (tmp_path / "trace_rank0.json" / "x").mkdir(parents=True)  # where the trace would be moved to
    proc, records = run_script("ddp_train.py", 1, ["--steps", 5, "--profile", tmp_path], torchrun=False, forked=True)
    errors = error_lines(proc.stderr)
    assert proc.returncode == 1 and len(errors) == 1 and records == [], proc.stderr[-3000:]
    assert errors[0].startswith(f"error: --profile {tmp_path}: the trace cannot be written"), errors


@pytest.mark.parametrize("warmup,steps,refused", [(3, 4, False), (4, 4, True), (9, 4, True)])
def test_timing_warmup_must_leave_a_timed_step(warmup, steps, refused):
    args = ["--timing-warmup-steps", warmup, "--steps", steps]
    if refused:
        assert f"--timing-warmup-steps {warmup} leaves no step of --steps {steps} to time" in one_line_refusal("ddp_train.py", args)
    else:
        proc, (record,) = run_script("ddp_train.py", 1, args, torchrun=False, forked=True)
        assert len(record["losses"]) == steps and record["step_seconds"] > 0


def test_a_short_run_times_what_its_default_warmup_leaves():
    base = TINY[:TINY.index("--timing-warmup-steps")] + TINY[TINY.index("--timing-warmup-steps") + 2:]
    proc, (record,) = run_script("ddp_train.py", 1, ["--steps", 2], torchrun=False, forked=True, base=base)
    assert record["config"]["timing_warmup_steps"] == 1


def test_powersgd_that_would_never_start_is_refused():
    error = one_line_refusal("ddp_train.py", ["--comm-hook", "powersgd", "--powersgd-start-iter", 4, "--steps", 4], nproc=2)
    assert "--powersgd-start-iter 4 is not below --steps 4: PowerSGD would never start" in error
