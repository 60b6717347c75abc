"""Checkpoints: resume continues the very same run, for every strategy (twice at another
world size); a rank killed mid-save leaves the previous checkpoint the one an elastic
restart resumes from, and the run ends as if nothing had happened; SIGTERM saves and
stops cleanly."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from harness import PARITY_ATOL, ROOT, TINY, checkpointed, launch, reference, run_script

RESUME_ATOL = 1e-6
# Each strategy's checkpointed parity run (4 steps, saved after 2 and 4), the world size
# to resume at, and the layout there. Two resume elsewhere, which DCP reshards: the
# pipeline's 2 stages continue as 1, and hybrid's FSDP over 4 ranks as a 2-stage pipeline.
HYBRID_DP4 = ("--pp", 1, "--dp-wrapper", "fsdp", "--schedule", "gpipe", "--micro-batches", 2)
RESUMABLE = [
    ("ddp_train.py", 2, (), 2, ()),
    ("model_parallel_train.py", 2, (), 2, ()),
    ("pipeline_train.py", 2, ("--schedule", "gpipe", "--micro-batches", 4), 1, ("--schedule", "gpipe", "--micro-batches", 4)),
    ("hybrid_train.py", 4, HYBRID_DP4, 2, ("--pp", 2, "--schedule", "gpipe", "--micro-batches", 2)),
    ("fsdp_train.py", 2, (), 2, ()),
    ("tensor_parallel_train.py", 2, (), 2, ()),
]


def assert_continues(resumed, full, start, atol=RESUME_ATOL):
    """atol: PARITY_ATOL where `full` is the single-process run and `resumed` had other
    ranks, whose gradient sums add up in another order."""
    assert resumed["start_step"] == start and len(resumed["losses"]) == len(full["losses"]) - start
    diffs = [abs(a - b) for a, b in zip(resumed["losses"], full["losses"][start:])]
    assert max(diffs) <= atol, f"resumed losses {resumed['losses']} vs uninterrupted {full['losses'][start:]}"


@pytest.mark.parametrize("script,nproc,args,resume_nproc,resume_args", RESUMABLE,
                         ids=[f"{s.removesuffix('_train.py')}-x{n}-to-x{r}" for s, n, _, r, _ in RESUMABLE])
def test_resume_continues_the_same_run(script, nproc, args, resume_nproc, resume_args, tmp_path):
    full, folder = checkpointed(script, nproc, *args)
    assert sorted(os.listdir(folder)) == ["step_00000002", "step_00000004"]
    shutil.copytree(folder / "step_00000002", tmp_path / "step_00000002")  # as if the run had died after step 2
    resumed = launch(script, resume_nproc, *resume_args, "--checkpoint-dir", tmp_path)
    assert_continues(resumed, full, start=2)


def test_a_finished_run_has_nothing_to_do_and_another_batch_is_refused(tmp_path):
    _, folder = checkpointed("ddp_train.py", 2)  # trained to its last step, 4
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    proc, records = run_script("ddp_train.py", 1, ["--checkpoint-dir", tmp_path], torchrun=False, forked=True)
    assert proc.returncode == 0 and records == [] and "nothing left to train" in proc.stdout, proc.stderr[-2000:]
    proc, records = run_script("ddp_train.py", 1, ["--checkpoint-dir", tmp_path, "--global-batch-size", 4], torchrun=False, forked=True)
    assert proc.returncode == 2 and records == [], proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and "was trained with --global-batch-size 8" in proc.stderr
    # Another model's checkpoint is refused by its shape, before its tensors are read.
    proc, records = run_script("ddp_train.py", 1, ["--checkpoint-dir", tmp_path, "--vocab-size", 600], torchrun=False, forked=True)
    assert proc.returncode == 2 and records == [] and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: {tmp_path}/step_00000004 holds a model with vocab_size 512, this run's has 600")


def test_the_last_step_is_saved_and_an_unreadable_newest_checkpoint_is_set_aside(tmp_path):
    args = ["--checkpoint-dir", tmp_path, "--checkpoint-every", "3"]
    _, (full,) = run_script("ddp_train.py", 1, args, torchrun=False, forked=True)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004"]  # 4 is no multiple of 3, but the last
    shard = next((tmp_path / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])  # a save cut short by a full disk, say
    proc, (resumed,) = run_script("ddp_train.py", 1, args, torchrun=False, forked=True)
    assert proc.stdout.count("skipping ") == 1 and f"skipping {tmp_path}/step_00000004: it does not load" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert_continues(resumed, full, start=3)
    # Nothing deleted: the unreadable one is kept beside the new step 4.
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004", "step_00000004.unreadable"]
    assert (tmp_path / "step_00000004.unreadable" / shard.name).stat().st_size == 1000
    # None loads: a failed load may have half-overwritten the weights, so it refuses to train.
    for step in ("step_00000003", "step_00000004"):
        (tmp_path / step / ".metadata").write_bytes(b"garbled")
    proc, records = run_script("ddp_train.py", 1, args, torchrun=False, forked=True)
    assert proc.returncode == 2 and records == [] and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"error: no checkpoint in {tmp_path} loads"), proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["step_00000003.unreadable", "step_00000004.unreadable", "step_00000004.unreadable-2"]


def test_hard_death_mid_save_restarts_from_the_last_complete_checkpoint(tmp_path):
    # Rank 1 is SIGKILLed after writing its part of the step-4 checkpoint, before the
    # commit: every file of step 4 may be on disk, but resume must pick step 2. Under
    # torchrun --max-restarts=1 the group restarts (the command README.md documents: a
    # restarted group must not reuse the dead rank's rendezvous store, pytorch#135712)
    # and the run must end exactly as if nothing had happened.
    args = ["--steps", "6", "--checkpoint-dir", tmp_path, "--checkpoint-every", "2"]
    proc, records = run_script("ddp_train.py", 2, args, torchrun_args=["--max-restarts=1"],
                               env={"TRAIN_FAULT": "kill-in-save:4:1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fault injection: kill-in-save on rank 1 at step 4" in proc.stderr
    assert f"resumed from {tmp_path}/step_00000002 at step 2" in proc.stdout, proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000004", "step_00000006"]
    assert_continues(records[0], reference("--steps", "6"), start=2, atol=PARITY_ATOL)


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    # The real torchrun command, with a DataLoader worker per rank: torchrun signals the
    # whole process group, workers included.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "ddp_train.py"),
           *TINY, "--num-workers", "1", "--steps", "100000", "--checkpoint-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 90
    while not proc.stdout.readline().startswith("step     3/"):  # training is under way
        assert time.monotonic() < deadline and proc.poll() is None, "the run did not get going"
    proc.send_signal(signal.SIGTERM)  # what a scheduler's time limit sends
    out, err = proc.communicate(timeout=90)
    stopped = [line for line in out.splitlines() if line.startswith("SIGTERM: stopping after step ")]
    assert len(stopped) == 1, out + err
    step = int(stopped[0].rsplit(" ", 1)[1])
    assert os.listdir(tmp_path) == [f"step_{step:08d}"] and "saved " in out and "done |" in out, out + err
    assert "[rank" not in err, "a rank failed instead of stopping cleanly"


def test_periodic_saves_are_written_behind_training(tmp_path):
    # The step-2 save takes 2 s longer to write: written behind training, step 3 is logged
    # before it is committed (the step-4 save then waits for it: one save at a time).
    args = ["--steps", "6", "--checkpoint-dir", tmp_path, "--checkpoint-every", "2"]
    proc, records = run_script("ddp_train.py", 2, args, env={"TRAIN_FAULT": "slow-save:2"}, forked=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    committed = lines.index(f"saved {tmp_path}/step_00000002 (written behind training)")
    assert any(line.startswith("step     3/") for line in lines[:committed]), proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000004", "step_00000006"]
    assert records[0]["checkpoints_saved"] == 3, records[0]
    # What it wrote behind training resumes the same run.
    shutil.rmtree(tmp_path / "step_00000004"), shutil.rmtree(tmp_path / "step_00000006")
    assert_continues(launch("ddp_train.py", 2, "--steps", 6, "--checkpoint-dir", tmp_path), reference("--steps", "6"), start=2, atol=PARITY_ATOL)


def test_a_failed_background_save_ends_the_job_and_keeps_the_last_checkpoint(tmp_path):
    # Rank 1's write of the step-4 checkpoint fails behind training: the job must fail
    # (not train on without the checkpoint it was asked for), within seconds, leaving step 2
    # the newest checkpoint and step 4 uncommitted.
    args = ["--steps", "100", "--checkpoint-dir", tmp_path, "--checkpoint-every", "2"]
    start = time.monotonic()
    proc, records = run_script("ddp_train.py", 2, args, env={"TRAIN_FAULT": "raise-in-save:4:1"}, timeout=60, forked=True)
    assert proc.returncode != 0 and records == [], proc.stdout[-2000:]
    assert time.monotonic() - start < 30
    assert "fault injection: raise-in-save on rank 1 at step 4" in proc.stderr
    assert "step_00000002" in os.listdir(tmp_path) and "step_00000004" not in os.listdir(tmp_path)
    assert not any(name.startswith("step_000001") for name in os.listdir(tmp_path))
