"""Launch the strategy scripts on CPU/gloo and read back the JSON results line each run
writes. Every parity test compares against one cached single-process run of
ddp_train.py on the same global batch. Runs that test the launcher's part (faults,
signals, restarts) go through torchrun itself; runs that must simply succeed fork their
ranks, with torchrun's environment, from a server that imported torch once."""

import atexit
import ctypes
import functools
import json
import logging
import os
import runpy
import socket
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
        "--num-workers", "0", "--device", "cpu", "--dtype", "fp32", "--timing-warmup-steps", "1", "--count-comm"]

PARITY_ATOL = 1e-5


def _exit_with(fn):
    """In a forked child: run fn, then end the process with fn's exit status (SystemExit's
    code, 1 for an uncaught error, 0 otherwise), its output flushed; never returns."""
    code = 1
    try:
        fn()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid, timeout):
    """A child's exit status, or None when it ran past timeout: then it and its process
    group are killed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def _torchrun(argv, env, stdout, stderr, timeout):
    """torchrun's own entry point, torch.distributed.run.main(argv), in a forked child of
    this test process: the launcher then needs no fresh interpreter importing torch (and
    tearing it down) for every launch, a third of a small launch's time on 2 cores. The
    workers it starts are fresh interpreters, exactly as under `torchrun`; test_checkpoint
    and test_run_all also run the real `torchrun` command. Returns the exit status."""
    pid = os.fork()
    if pid == 0:  # the launcher
        def launcher():
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

        _exit_with(launcher)
    code = _wait(pid, timeout)
    if code is not None:
        return code
    raise TimeoutError(f"torchrun {' '.join(argv)} did not finish in {timeout} s")


# ---- Forked ranks: parity runs without an interpreter start per rank -----------------
# A parity run's ranks each spend ~1.5 s of one of the 2 cores importing torch, most of a
# tiny run's time. So the runs that test what a script computes, not how it is launched
# (launch(), reference(), run_script(forked=True)), fork their ranks from one server
# process that imported torch and the packages the scripts use, once for the session, and
# never ran a torch op or started a thread. Each rank gets torchrun's
# environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT: env:// rendezvous) and runs
# the script as __main__; when one rank fails the others are ended, as torchrun does.
# What torchrun's agent adds (restarts, signals, a dead peer) is tested through the real
# launcher: run_script() and the torchrun commands of test_checkpoint and test_run_all.

# The packages the strategy scripts import; not the scripts: common.py reads RANK on import.
PRELOAD = ["torch", "numpy", "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.tensor.parallel",
           "torch.distributed.algorithms.ddp_comm_hooks", "torch.distributed.checkpoint", "torch.utils.data"]


def _die_with_parent():
    """SIGKILL this process when its parent dies (Linux's PR_SET_PDEATHSIG): a test run
    ended by Ctrl-C or a kill leaves no job behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def _run_rank(script, argv, env):
    """One rank, in a process forked from the server: the script as __main__; never returns."""
    def rank():
        _die_with_parent()
        atexit._clear()  # the server's exit handlers are not the script's
        sys.stdout, sys.stderr = open(1, "w", buffering=1, closefd=False), open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [script, *argv]
        sys.path[0] = os.path.dirname(script)  # as `python script.py` has it
        try:
            runpy.run_path(script, run_name="__main__")
        finally:
            atexit._run_exitfuncs()

    _exit_with(rank)


def _run_job(request):
    """One run: its ranks forked and waited for; never returns. When one fails the others are
    ended, as torchrun does, unless the request asks for every rank's own exit status
    (rank_codes: a file to write them to, with the job's session id), which each rank then
    reaches by itself."""
    _die_with_parent()
    # A session of its own, whose id every process of the job keeps, DataLoader workers that
    # leave their rank's process group included; its process group lets the server end it.
    os.setsid()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nproc, ranks, code = request["nproc"], {}, 0
    for rank in range(nproc):
        env = dict(request["env"])
        if request["torchrun"]:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
        pid = os.fork()
        if pid == 0:
            _run_rank(request["script"], request["argv"], env)
        ranks[pid] = rank
    codes = {}
    while ranks:
        pid, status = os.wait()
        rank_code = codes[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
        if rank_code and not code:
            code = rank_code if rank_code > 0 else 128 - rank_code
            if not request.get("rank_codes"):
                for other in ranks:
                    os.kill(other, signal.SIGTERM)
    if request.get("rank_codes"):
        with open(request["rank_codes"], "w") as f:
            json.dump({"codes": [codes[rank] for rank in range(nproc)], "session": os.getsid(0)}, f)
    os._exit(code)


def _serve():
    """The server: one JSON request a line on stdin, its exit status a line on stdout."""
    for name in PRELOAD:
        __import__(name)
    requests, replies = os.fdopen(os.dup(0)), os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0), os.dup2(devnull, 1)  # jobs inherit neither end of the protocol
    for line in requests:
        request = json.loads(line)
        if "torchao.float8" not in sys.modules and "--float8" in request["argv"]:
            import torchao.float8  # noqa: F401  once, for every float8 run after it
        with open(request["stdout"], "w") as out, open(request["stderr"], "w") as err:
            pid = os.fork()
            if pid == 0:
                os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
                _run_job(request)
        code = _wait(pid, request["timeout"])
        replies.write(json.dumps({"code": code}) + "\n")


@functools.lru_cache(maxsize=None)
def _server():
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, __file__], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    atexit.register(_stop, server)
    return server


def _stop(server):
    """End of the session: closing its requests ends the server as any process ends (its
    exit handlers remove the CHECKPOINTS folder it made on import); killed if a job still
    runs (a test interrupted), which takes the job with it."""
    server.stdin.close()
    try:
        server.wait(timeout=5)
    except subprocess.TimeoutExpired:
        server.kill()


def _forked(script, nproc, argv, env, stdout, stderr, timeout, torchrun, rank_codes=None):
    """Run one job on the server; returns its exit status."""
    server = _server()
    request = {"script": script, "nproc": nproc, "argv": argv, "env": env, "stdout": stdout, "stderr": stderr,
               "timeout": timeout, "torchrun": torchrun, "rank_codes": rank_codes}
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    reply = server.stdout.readline()
    assert reply, f"the test server died (exit status {server.poll()})"
    code = json.loads(reply)["code"]
    if code is None:
        raise TimeoutError(f"{script} x{nproc} {' '.join(argv)} did not finish in {timeout} s")
    return code


def run_script(script, nproc=1, args=(), env=None, timeout=120, torchrun=True, torchrun_args=(), forked=False, base=TINY, every_rank=False):
    """Run a script (a path under the repository, or anywhere) on CPU/gloo with the tiny
    model, as `torchrun --standalone --nproc_per_node=N script.py ...` or, without
    torchrun, as a plain `python script.py` (the world-of-one path); forked: its ranks
    forked from the test server (see above). every_rank (forked only): no rank is ended
    because another failed, proc.rank_codes holds each rank's exit status and proc.session
    the session id every process of the job had. Returns (CompletedProcess, results records)."""
    with tempfile.TemporaryDirectory() as tmp:
        results = os.path.join(tmp, "results.jsonl")
        argv = [str(ROOT / script), *base, *map(str, args), "--results", results]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        assert forked or not every_rank, "torchrun ends the other ranks when one fails"
        if forked:
            assert not torchrun_args, "the test server has no torchrun options"
            out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
            codes = os.path.join(tmp, "codes") if every_rank else None
            code = _forked(argv[0], nproc, argv[1:], full_env, out, err, timeout, torchrun, codes)
            proc = subprocess.CompletedProcess(argv, code, Path(out).read_text(), Path(err).read_text())
            if every_rank:
                ended = json.loads(Path(codes).read_text())
                proc.rank_codes, proc.session = ended["codes"], ended["session"]
        elif torchrun:
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
    proc, records = run_script(script, nproc, args, forked=True)
    assert proc.returncode == 0, f"{script} x{nproc} {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert len(records) == 1, f"expected one results line, got {len(records)}"
    return records[0]


def simulate(script, n, rank=0, *args):
    """A one-process run as rank `rank` of an n-rank job (--simulate; no torchrun: it is one
    process); cached like launch()."""
    return launch(script, 1, "--simulate", n, "--simulate-rank", rank, *args)


def checkpointed(script, nproc, *args):
    """A parity run that also saves a checkpoint every 2 steps, into a folder of its own
    under CHECKPOINTS; returns (record, folder). Cached like launch()."""
    folder = CHECKPOINTS / "-".join([script.removesuffix("_train.py"), str(nproc), *map(str, args)]).replace("/", "_")
    return launch(script, nproc, *args, "--checkpoint-dir", str(folder), "--checkpoint-every", "2"), folder


@functools.lru_cache(maxsize=None)
def reference(*args):
    """The single-process baseline (ddp_train.py, world size 1, no torchrun) for these
    arguments, run once per test session."""
    proc, records = run_script("ddp_train.py", 1, args, torchrun=False, forked=True)
    assert proc.returncode == 0, f"reference {args} failed:\n{proc.stderr[-5000:]}"
    return records[0]


def assert_losses_match(run, ref, atol=PARITY_ATOL):
    assert len(run["losses"]) == len(ref["losses"]), (run["losses"], ref["losses"])
    diffs = [abs(a - b) for a, b in zip(run["losses"], ref["losses"])]
    assert max(diffs) <= atol, f"per-step losses differ by up to {max(diffs):.2e} (atol {atol:.0e}):\n  run {run['losses']}\n  ref {ref['losses']}"


def loss_diffs(run, ref):
    return [abs(a - b) for a, b in zip(run["losses"], ref["losses"])]


def comm(run, kind, group=None, dtype=None):
    """(calls, bytes, dtypes) of one kind of collective in the run's counted step (rank 0's),
    in every group or in the one of these global ranks, of every dtype or of this one."""
    entries = [e for e in run["comm_per_step"] if e["kind"] == kind and group in (None, e["group"]) and dtype in (None, e["dtype"])]
    return sum(e["calls"] for e in entries), sum(e["bytes"] for e in entries), {e["dtype"] for e in entries}


def param_bytes(run, dtype_bytes=4):
    return run["params"] * dtype_bytes


# The torch.distributed.pipelining class each --schedule promises (README): written out
# here, not read from pipeline_train.SCHEDULES, so a name that builds another class fails.
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                   "zero-bubble": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def assert_pipeline_ran(run, pp, micro_batches, grad_accum, pp_group=None):
    """What rank 0's last step shows of the schedule: the class that ran it, which stages
    it ran, how many micro-batches each, in which order, and what it sent to its peers."""
    import common
    import pipeline_train

    schedule, per_rank = run["schedule"], run["stages_per_rank"]
    n_stages = pp * per_rank
    assert run["schedule_class"] == TORCH_SCHEDULES[schedule], (schedule, run["schedule_class"])
    # Each grad-accum round runs the schedule's order for rank 0 once: the order the replay uses.
    assert run["actions_last_step"] == run["pipeline_order"]["0"] * grad_accum, (run["actions_last_step"], run["pipeline_order"]["0"])
    mine = pipeline_train.stages_of_rank(schedule, 0, pp, per_rank)
    actions = [(a[0], int(a[1:].split(":")[0]), int(a.split(":")[1])) for a in run["actions_last_step"]]
    assert sorted({s for _, s, _ in actions}) == sorted(mine), actions
    backward = {"I", "W"} if schedule in pipeline_train.ZERO_BUBBLE else {"B"}
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


if __name__ == "__main__":
    _serve()
