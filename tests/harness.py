"""Launch the strategy scripts the way a user does (torchrun on CPU/gloo) and read back
the JSON results line each run writes. Every parity test compares against one cached
single-process run of ddp_train.py on the same global batch."""

import atexit
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch.distributed.run  # noqa: F401  imported once here, for every forked launcher

ROOT = Path(__file__).resolve().parent.parent
# Checkpoints written by parity runs, which the resume tests then continue from.
CHECKPOINTS = Path(tempfile.mkdtemp(prefix="parity-checkpoints-"))
atexit.register(shutil.rmtree, CHECKPOINTS, ignore_errors=True)

# Tiny model, few steps, no DataLoader workers: fast on 2 CPU cores, and fp32 so that
# parallel and single-process runs can agree to ~1e-5.
TINY = ["--model", "tiny", "--seq-len", "32", "--global-batch-size", "8", "--steps", "4",
        "--num-workers", "0", "--device", "cpu", "--dtype", "fp32", "--timing-warmup-steps", "1"]

PARITY_ATOL = 1e-5


def _torchrun(argv, env, stdout, stderr, timeout):
    """torchrun's own entry point, torch.distributed.run.main(argv), in a forked child of
    this test process: the launcher then needs no fresh interpreter importing torch (and
    tearing it down) for every launch, a third of a small launch's time on 2 cores. The
    workers it starts are fresh interpreters, exactly as under `torchrun`; test_checkpoint
    and test_run_all also run the real `torchrun` command. Returns the exit status."""
    pid = os.fork()
    if pid == 0:  # the launcher
        code = 1
        try:
            os.setpgrp()  # its workers join this process group, so a timeout can end them all
            os.dup2(stdout.fileno(), 1)
            os.dup2(stderr.fileno(), 2)
            # Python's streams and torch's log handlers still point where pytest had them.
            sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
            for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
                for handler in getattr(logger, "handlers", []):
                    if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                        handler.setStream(sys.stderr)
            os.chdir(ROOT)
            os.environ.clear()
            os.environ.update(env)
            from torch.distributed.run import main

            main(argv)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise TimeoutError(f"torchrun {' '.join(argv)} did not finish in {timeout} s")


def run_script(script, nproc=1, args=(), env=None, timeout=120, torchrun=True, torchrun_args=()):
    """Run a script on CPU/gloo with the tiny model, as `torchrun --standalone
    --nproc_per_node=N script.py ...` or, without torchrun, as a plain `python script.py`
    (the world-of-one path). Returns (CompletedProcess, results records)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.jsonl")
        argv = [str(ROOT / script), *TINY, *map(str, args), "--results", results]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if torchrun:
            argv = ["--standalone", f"--nproc_per_node={nproc}", *torchrun_args, *argv]
            with open(os.path.join(tmp, "out"), "w+") as out, open(os.path.join(tmp, "err"), "w+") as err:
                code = _torchrun(argv, full_env, out, err, timeout)
                out.seek(0), err.seek(0)
                proc = subprocess.CompletedProcess(argv, code, out.read(), err.read())
        else:
            proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        records = [json.loads(line) for line in open(results)] if os.path.exists(results) else []
    return proc, records


def launch(script, nproc=1, *args):
    """Run a script that must succeed under torchrun; return its results record. Cached:
    tests asking for the same run share one launch (each costs seconds of imports)."""
    return _launch(script, nproc, *map(str, args))


@functools.lru_cache(maxsize=None)
def _launch(script, nproc, *args):
    proc, records = run_script(script, nproc, args)
    assert proc.returncode == 0, f"{script} x{nproc} {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert len(records) == 1, f"expected one results line, got {len(records)}"
    return records[0]


def checkpointed(script, nproc, *args):
    """A parity run that also saves a checkpoint every 2 steps, into a folder of its own
    under CHECKPOINTS; returns (record, folder). Cached like launch()."""
    folder = CHECKPOINTS / "-".join([script.removesuffix("_train.py"), str(nproc), *map(str, args)]).replace("/", "_")
    return launch(script, nproc, *args, "--checkpoint-dir", str(folder), "--checkpoint-every", "2"), folder


@functools.lru_cache(maxsize=None)
def reference(*args):
    """The single-process baseline (ddp_train.py, world size 1, no torchrun) for these
    arguments, run once per test session."""
    proc, records = run_script("ddp_train.py", 1, args, torchrun=False)
    assert proc.returncode == 0, f"reference {args} failed:\n{proc.stderr[-5000:]}"
    return records[0]


def assert_losses_match(run, ref, atol=PARITY_ATOL):
    assert len(run["losses"]) == len(ref["losses"]), (run["losses"], ref["losses"])
    diffs = [abs(a - b) for a, b in zip(run["losses"], ref["losses"])]
    assert max(diffs) <= atol, f"per-step losses differ by up to {max(diffs):.2e} (atol {atol:.0e}):\n  run {run['losses']}\n  ref {ref['losses']}"


def loss_diffs(run, ref):
    return [abs(a - b) for a, b in zip(run["losses"], ref["losses"])]


def comm(run, kind, group=None):
    """(calls, bytes, dtypes) of one kind of collective in the run's counted step (rank 0's),
    in every group or in the one of these global ranks."""
    entries = [e for e in run["comm_per_step"] if e["kind"] == kind and group in (None, e["group"])]
    return sum(e["calls"] for e in entries), sum(e["bytes"] for e in entries), {e["dtype"] for e in entries}


def param_bytes(run, dtype_bytes=4):
    return run["params"] * dtype_bytes


def assert_pipeline_ran(run, pp, micro_batches, grad_accum, pp_group=None):
    """What rank 0's last step shows of the schedule: which stages it ran, how many
    micro-batches each, in which order, and what it sent to its pipeline peers."""
    import common

    schedule, per_rank = run["schedule"], run["stages_per_rank"]
    n_stages = pp * per_rank
    mine = common.stages_of_rank(schedule, 0, pp, per_rank)
    actions = [(a[0], int(a[1:].split(":")[0]), int(a.split(":")[1])) for a in run["actions_last_step"]]
    assert sorted({s for _, s, _ in actions}) == sorted(mine), actions
    backward = {"I", "W"} if schedule in common.ZERO_BUBBLE else {"B"}
    assert {kind for kind, _, _ in actions} == {"F"} | backward, actions
    for stage in mine:
        for kind in {"F"} | backward:
            assert sum(1 for k, s, _ in actions if (k, s) == (kind, stage)) == micro_batches * grad_accum, (kind, stage, actions)
    # Micro-batches alive on stage 0 (forward done, backward not): GPipe keeps all of them,
    # 1F1B at most as many as there are stages after it.
    alive = peak = 0
    for kind, stage, _ in actions:
        if stage == mine[0]:
            alive += {"F": 1, "B": -1, "I": -1}.get(kind, 0)
            peak = max(peak, alive)
    if schedule == "gpipe":
        assert peak == micro_batches, actions
    elif schedule == "1f1b":
        assert peak == min(micro_batches, n_stages), actions
    # Each micro-batch's activation crosses every boundary forward, its gradient backward.
    crossings = sum((s < n_stages - 1) + (s > 0) for s in mine)
    micro_batch = run["global_batch_size"] // (run["mesh"]["dp"] if "mesh" in run else 1) // grad_accum // micro_batches
    activation = micro_batch * run["seq_len"] * common.PRESETS[run["model"]].d_model * 4
    assert comm(run, "send", pp_group)[:2] == (crossings * micro_batches * grad_accum, crossings * micro_batches * grad_accum * activation)
