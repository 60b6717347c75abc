"""DDP must compute the same training run as one process on the same global batch."""

import math
import subprocess
import sys

import pytest
from harness import PARITY_ATOL, ROOT, TINY, assert_losses_match, checkpointed, comm, launch, loss_diffs, param_bytes, reference

import common

REQUIRED_FIELDS = {
    "strategy": str, "world_size": int, "device": str, "gpu_name": type(None), "model": str, "params": int,
    "global_batch_size": int, "seq_len": int, "steps": int, "losses": list, "samples_per_sec": float,
    "tokens_per_sec": float, "mfu": type(None), "peak_mem_gib": float, "mem_pct": float,
    "comm_pct": float, "torch_version": str, "config": dict,
}


@pytest.mark.parametrize("extra", [
    [],
    ["--grad-accum", "2", "--activation-checkpointing"],
], ids=["plain", "grad-accum-activation-checkpointing"])
def test_ddp_two_ranks_match_single_process(extra):
    # The plain run also saves checkpoints, which test_checkpoint resumes from.
    run = launch("ddp_train.py", 2, *extra) if extra else checkpointed("ddp_train.py", 2)[0]
    assert_losses_match(run, reference())
    # The textbook volume: one all-reduce of every fp32 gradient per optimizer step, and
    # nothing else. With accumulation too: the first micro-step, forward and backward, runs
    # under no_sync(), so it adds no all-reduce (parity cannot see one more).
    assert [e["kind"] for e in run["comm_per_step"]] == ["all_reduce"]
    assert comm(run, "all_reduce")[1:] == (param_bytes(run), {"float32"})


def test_ddp_clipping_matches_when_it_acts():
    clip = ["--grad-clip", "0.3"]
    ref = reference(*clip)
    assert min(ref["grad_norms"]) > 0.3, "the clip threshold must be below every step's gradient norm"
    assert max(loss_diffs(ref, reference())[1:]) > 1e-4, "a tighter clip should change the run"
    assert_losses_match(launch("ddp_train.py", 2, *clip), ref)


@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_comm_hook_is_close_but_not_exact(hook):
    extra = ["--comm-hook", hook]
    if hook == "powersgd":
        extra += ["--powersgd-start-iter", "2"]  # plain all-reduce for steps 1-2, compressed after
    run, ref = launch("ddp_train.py", 2, *extra), reference()
    # What goes on the wire: half-width gradients, or PowerSGD's low-rank factors (by the
    # last, counted step, compression has started) with the small vectors uncompressed.
    calls, nbytes, dtypes = comm(run, "all_reduce")
    if hook == "powersgd":
        assert dtypes == {"float32"} and nbytes < param_bytes(run) / 3, (nbytes, param_bytes(run))
    else:
        assert dtypes == {"float16" if hook == "fp16" else "bfloat16"} and nbytes == param_bytes(run, 2)
    diffs = loss_diffs(run, ref)
    exact_steps = 3 if hook == "powersgd" else 1  # a step's loss shows the previous steps' updates
    assert max(diffs[:exact_steps]) <= PARITY_ATOL, diffs
    assert 1e-6 < max(diffs[exact_steps:]) < 0.05, f"{hook}: compression should perturb the run slightly: {diffs}"


def test_results_line_has_every_field():
    record = checkpointed("ddp_train.py", 2)[0]
    for field, kind in REQUIRED_FIELDS.items():
        assert isinstance(record[field], kind), f"{field} = {record[field]!r} is not {kind.__name__}"
    assert record["strategy"] == "ddp" and record["world_size"] == 2 and record["device"] == "cpu"
    assert len(record["losses"]) == record["steps"] == 4
    assert all(math.isfinite(x) for x in record["losses"])
    assert record["samples_per_sec"] > 0 and record["tokens_per_sec"] == pytest.approx(record["samples_per_sec"] * record["seq_len"])
    assert 0 <= record["comm_pct"] <= 100 and record["peak_mem_gib"] > 0
    assert record["config"]["global_batch_size"] == 8


# ddp_train.py under a torch.compile that records what it is given and compiles nothing.
RECORD_COMPILES = """
import runpy, sys, torch
compiled = []
def record(fn, *args, **kwargs):
    compiled.append(type(fn.__self__).__name__ if hasattr(fn, "__self__") else fn.__name__)
    return fn
torch.compile = record
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("compiled:", ",".join(compiled))
"""


def test_compile_sends_every_block_and_the_loss_through_torch_compile():
    cfg = common.PRESETS["tiny"]
    proc = subprocess.run([sys.executable, "-c", RECORD_COMPILES, "ddp_train.py", *TINY, "--steps", "2", "--compile"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = proc.stdout.split("compiled:")[-1].split()[0].split(",")
    assert sorted(compiled) == sorted(["Block"] * cfg.n_layers + ["loss_fn"]), compiled
