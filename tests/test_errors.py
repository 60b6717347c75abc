"""What a script cannot serve it refuses before training, with one line from rank 0 that
says what to change; a NaN loss stops the run naming the step; a silent peer, a stall of
every rank, an uncaught error, a broken pipe and Ctrl-C each end every process of the job,
DataLoader workers included, within seconds. Never a hang, never a traceback from every
rank for a mistake the user can fix."""

import importlib
import os
import signal
import struct
import subprocess
import sys
import time
import uuid

import pytest
import torch.distributed as dist

import common
from harness import ROOT, TINY, run_script

SCRIPTS = ["ddp_train.py", "model_parallel_train.py", "pipeline_train.py", "hybrid_train.py", "fsdp_train.py", "tensor_parallel_train.py", "context_parallel_train.py"]

# Refused while the command line is read, before any process group or model exists: one
# entry per class of mistake (a number out of range or not finite, a file or folder that
# is missing, of the wrong kind or unwritable, options that contradict each other).
# Each runs through the script's own main(), in this process, under common.run.
BAD_OPTIONS = [
    (["--lr", "-1"], "argument --lr: '-1' is not a finite number above 0"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
    (["--weight-decay", "inf"], "argument --weight-decay: 'inf' is not a finite number"),
    (["--grad-clip", "-1"], "argument --grad-clip: '-1' is not a finite number of at least 0"),
    (["--grad-clip", "nan"], "argument --grad-clip: 'nan'"),
    (["--num-workers", "-1"], "argument --num-workers: '-1' is not a whole number of at least 0"),
    (["--timeout", "0"], "argument --timeout: '0' is not a number of seconds from 1"),
    (["--timeout", "1e999"], "argument --timeout: '1e999'"),
    (["--checkpoint-every", "-1"], "argument --checkpoint-every: '-1'"),
    (["--seed", "-1"], "argument --seed: '-1'"),
    (["--steps", "0"], "argument --steps: '0' is not a whole number of at least 1"),
    (["--grad-accum", "2.5"], "argument --grad-accum: '2.5'"),
    (["--timing-warmup-steps", "-2"], "argument --timing-warmup-steps"),
    (["--model", "huge"], "argument --model: invalid choice: 'huge'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--seq-len", "65"], "--seq-len 65 exceeds the tiny preset's context of 64"),
    (["--lr-warmup-steps", "5"], "--lr-warmup-steps 5 must be at most --steps 4"),
    (["--checkpoint-every", "2"], "--checkpoint-every needs --checkpoint-dir"),
    (["--profile", "{tmp}/trace"], "--profile traces 3 steps after --timing-warmup-steps 1 and one more: it needs --steps of at least 5"),
    (["--data", "{tmp}/missing.bin"], "--data {tmp}/missing.bin does not exist"),
    (["--data", "{tmp}"], "--data {tmp} is not a file"),
    (["--data", "{tmp}/odd.bin"], "holds 3 bytes, an odd count"),
    (["--data", "{tmp}/ids.bin"], "holds token id 999, beyond the vocabulary of 512: set --vocab-size 1000"),
    (["--results", "{tmp}/missing/results.jsonl"], "--results {tmp}/missing/results.jsonl: the folder {tmp}/missing does not exist"),
    (["--results", "{tmp}"], "--results {tmp} is a folder"),
    (["--checkpoint-dir", "{tmp}/odd.bin"], "--checkpoint-dir {tmp}/odd.bin is a file, not a folder"),
    (["--checkpoint-dir", "{tmp}/odd.bin/sub"], "--checkpoint-dir {tmp}/odd.bin/sub cannot be made"),
    (["--profile", "{tmp}/odd.bin", "--steps", "5"], "--profile {tmp}/odd.bin is a file, not a folder"),
    (["--simulate", "1"], "argument --simulate: '1' is not a number of ranks from 2"),
    (["--simulate-rank", "1"], "--simulate-rank needs --simulate N"),
    (["--simulate", "4", "--simulate-rank", "4"], "--simulate-rank 4 must be below --simulate 4"),
    (["--simulate", "4", "--checkpoint-dir", "{tmp}/ck"], "--simulate cannot checkpoint"),
]
# Each strategy's own options, refused the same way.
BAD_SCRIPT_OPTIONS = [
    ("ddp_train.py", ["--comm-hook", "int8"], "argument --comm-hook: invalid choice: 'int8'"),
    ("ddp_train.py", ["--powersgd-start-iter", "1"], "argument --powersgd-start-iter: '1' is not a whole number of at least 2"),
    ("pipeline_train.py", ["--micro-batches", "0"], "argument --micro-batches: '0'"),
    ("pipeline_train.py", ["--split", "a,b"], "argument --split: 'a,b' is not a comma-separated list of block counts"),
    ("hybrid_train.py", ["--split", "0,8"], "argument --split: '0,8'"),
    ("hybrid_train.py", ["--pp", "-2"], "argument --pp: '-2'"),
    ("hybrid_train.py", ["--stages-per-rank", "0"], "argument --stages-per-rank: '0'"),
    ("model_parallel_train.py", ["--split", "4,"], "argument --split: '4,'"),
    ("tensor_parallel_train.py", ["--dp", "0"], "argument --dp: '0'"),
    ("tensor_parallel_train.py", ["--simulate", "2", "--sequence-parallel", "--seq-len", "31"], "--sequence-parallel splits --seq-len 31 over tp 2"),
]


@pytest.fixture
def bad_files(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"abc")
    (tmp_path / "ids.bin").write_bytes(struct.pack("<101H", *range(100), 999))  # the one id too large comes last
    return tmp_path


def refuse_in_process(script, argv, capsys, monkeypatch):
    """Run a script's main() under common.run, as `python script.py ARGV` would; returns
    (exit status, stderr lines)."""
    module = importlib.import_module(script.removesuffix(".py"))
    monkeypatch.setattr(sys, "argv", [script, *TINY, *argv])
    with pytest.raises(SystemExit) as exit_:
        common.run(module.main)
    assert not dist.is_initialized(), "refused only after a process group existed"
    return exit_.value.code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("argv,message", BAD_OPTIONS, ids=[" ".join(a) for a, _ in BAD_OPTIONS])
def test_a_bad_option_is_refused_in_one_line_before_anything_starts(argv, message, bad_files, capsys, monkeypatch):
    # Spread the cases over every script: each must refuse what it shares through common.py.
    script = SCRIPTS[BAD_OPTIONS.index((argv, message)) % len(SCRIPTS)]
    argv = [a.format(tmp=bad_files) for a in argv]
    code, lines = refuse_in_process(script, argv, capsys, monkeypatch)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (script, lines)
    assert message.format(tmp=bad_files) in lines[0], (script, lines)


@pytest.mark.parametrize("script,argv,message", BAD_SCRIPT_OPTIONS, ids=[f"{s.removesuffix('_train.py')} {' '.join(a)}" for s, a, _ in BAD_SCRIPT_OPTIONS])
def test_a_bad_strategy_option_is_refused_in_one_line(script, argv, message, capsys, monkeypatch):
    code, lines = refuse_in_process(script, argv, capsys, monkeypatch)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


# Refused once the world is known (its size decides), still before any model exists: a
# launch of two ranks with torchrun's environment, where every rank refuses and only rank 0
# says why.
BAD_LAYOUTS = [
    ("ddp_train.py", ["--global-batch-size", "3"], "--global-batch-size 3 must divide evenly over 2 ranks"),
    ("pipeline_train.py", ["--schedule", "interleaved-1f1b", "--stages-per-rank", "5"], "10 pipeline stages but only 8 blocks"),
    ("pipeline_train.py", ["--schedule", "1f1b", "--micro-batches", "1"], "--schedule 1f1b cannot run 1 micro-batches over 2 stages"),
    ("model_parallel_train.py", ["--split", "3,3"], "--split 3,3 must give every part at least one block and 8 in all"),
    ("hybrid_train.py", ["--pp", "1", "--dp-wrapper", "ddp", "--schedule", "zero-bubble"], "DDP's all-reduce hooks never fire"),
]


def error_lines(stderr):
    return [line for line in stderr.splitlines() if "error: " in line and not line.startswith(("E1", "W1", " "))]


@pytest.mark.parametrize("script,args,message", BAD_LAYOUTS, ids=[f"{s.removesuffix('_train.py')}-{a[-1]}" for s, a, _ in BAD_LAYOUTS])
def test_a_layout_the_world_cannot_serve_is_refused_once(script, args, message):
    # No rank is ended because another one left (torchrun's agent would end the slower one
    # wherever it was, before or after its refusal): the output is read once every rank
    # has come to its own end, which must be the refusal, exit status 2, on every rank.
    proc, records = run_script(script, 2, args, timeout=60, forked=True, every_rank=True)
    assert proc.rank_codes == [2, 2], (proc.rank_codes, proc.stderr[-3000:])
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], proc.stderr[-3000:]
    assert "[rank" not in proc.stderr and "Traceback" not in proc.stderr and "step " not in proc.stdout and records == []


def test_nan_loss_stops_the_run_naming_the_step():
    # Every rank sees the agreed NaN and stops by itself (none ended for another's exit, which
    # under torchrun could take rank 0 before it says why); only rank 0 speaks.
    proc, records = run_script("ddp_train.py", 2, ["--steps", "6"], env={"TRAIN_FAULT": "nan:3"}, timeout=60, forked=True, every_rank=True)
    errors = error_lines(proc.stderr)
    assert proc.rank_codes == [3, 3], (proc.rank_codes, proc.stderr[-3000:])
    assert len(errors) == 1 and errors[0].startswith("error: loss is nan at step 3"), proc.stderr[-3000:]
    assert "step     3/" not in proc.stdout and records == []


# ---- Every way out ends every process, DataLoader workers included, within seconds.

def processes_marked(marker):
    """Live processes whose environment holds marker (DataLoader workers inherit it)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().split(")")[-1].split()[0] != "Z":  # a zombie is already dead
                            found.append(int(pid))
        except OSError:
            pass
    return found


def processes_in_session(session):
    """Live processes of a session (a forked job's: its ranks and their DataLoader workers,
    which leave their rank's process group but not its session)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as s:
                state, _, _, sid = s.read().split(")")[-1].split()[:4]
        except OSError:
            continue
        if int(sid) == session and state != "Z":
            found.append(int(pid))
    return found


def wait_all_gone(find, within=10):
    """Until find() finds no process (a DataLoader worker sees its trainer gone within 5 s);
    what is left after `within` seconds is killed, and the test fails."""
    deadline = time.monotonic() + within
    while left := find():
        if time.monotonic() > deadline:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"processes left running: {left}")
        time.sleep(0.2)


def assert_all_gone(marker, within=10):
    wait_all_gone(lambda: processes_marked(marker), within)


def test_an_uncaught_error_ends_the_job_and_its_dataloader_workers():
    marker = f"TEST_MARKER={uuid.uuid4()}"
    start = time.monotonic()
    proc, records = run_script("ddp_train.py", 2, ["--steps", "50", "--num-workers", "2"], timeout=60,
                               env={"TRAIN_FAULT": "raise:2:1", marker.split("=")[0]: marker.split("=")[1]})
    assert proc.returncode != 0 and "fault injection: an uncaught error at step 2" in proc.stderr and records == []
    assert time.monotonic() - start < 30
    assert_all_gone(marker)


def test_every_rank_stalled_ends_the_job_within_the_timeout_in_one_line():
    # No collective is waiting on a live peer here, so only each rank's step watchdog can end
    # it. No rank is ended because another left (under torchrun the first rank whose
    # watchdog fires takes the others with it, rank 0 too, before it has said why): every
    # rank must end by its own watchdog, its DataLoader worker with it, and only rank 0 speak.
    start = time.monotonic()
    proc, records = run_script("ddp_train.py", 2, ["--steps", "50", "--timeout", "3", "--num-workers", "1"], env={"TRAIN_FAULT": "hang:2"},
                               timeout=30, forked=True, every_rank=True)
    errors = error_lines(proc.stderr)
    assert proc.rank_codes == [1, 1], (proc.rank_codes, proc.stderr[-3000:])
    assert len(errors) == 1 and errors[0].startswith("error: no progress for 3 s after step 1"), proc.stderr[-3000:]
    assert time.monotonic() - start < 30 and records == []
    wait_all_gone(lambda: processes_in_session(proc.session))


def test_a_silent_peer_fails_the_job_within_the_timeout():
    start = time.monotonic()
    proc, records = run_script("ddp_train.py", 2, ["--steps", "50", "--timeout", "3"], env={"TRAIN_FAULT": "hang:2:1"}, timeout=30,
                               forked=True, every_rank=True)
    errors = error_lines(proc.stderr)
    # Rank 0 waits in a collective for rank 1: it times out, or sees rank 1's watchdog end
    # it. Every rank comes to its own end (none is ended for another's), only rank 0 speaks.
    assert proc.rank_codes == [1, 1], (proc.rank_codes, proc.stderr[-3000:])
    assert len(errors) == 1 and errors[0].startswith("error: rank 0 lost a peer ("), proc.stderr[-3000:]
    assert time.monotonic() - start < 30 and records == []


def plain_run(marker, *args, **popen):
    """`python ddp_train.py` (a world of one) with DataLoader workers, marked for assert_all_gone."""
    cmd = [sys.executable, str(ROOT / "ddp_train.py"), *TINY, "--steps", "100000", "--num-workers", "2", *args]
    name, value = marker.split("=")
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", name: value}, text=True, **popen)


def test_a_broken_pipe_ends_the_run():
    # `python ddp_train.py | head -2`: the reader leaves, the trainer must not linger.
    marker = f"TEST_MARKER={uuid.uuid4()}"
    proc = plain_run(marker, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline(), proc.stdout.readline()
    proc.stdout.close()  # as head exits
    assert proc.wait(timeout=30) != 0
    assert "Traceback" not in proc.stderr.read()
    assert_all_gone(marker)


def test_ctrl_c_ends_the_run_and_its_workers_in_one_line():
    marker = f"TEST_MARKER={uuid.uuid4()}"
    # A terminal's job takes SIGINT as default, whatever this test run inherited (a suite
    # started in the background, or under nohup, ignores it and passes that on).
    proc = plain_run(marker, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    while not proc.stdout.readline().startswith("step     2/"):  # training is under way
        assert proc.poll() is None, proc.stderr.read()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends its foreground process group
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip() == "interrupted", err
    assert_all_gone(marker)
