"""Every pipeline schedule must compute the single-process run: at 2 and 4 ranks, with
several micro-batch counts, with and without gradient accumulation, with clipping."""

import pytest

import pipeline_train
from harness import assert_losses_match, assert_pipeline_ran, checkpointed, launch, reference, run_script

CLIP = ["--grad-clip", "0.3"]  # below every step's gradient norm (see test_ddp)
CASES = [
    # schedule, ranks, micro-batches, extra flags. GPipe and 1F1B run the same order where
    # micro-batches equal stages: each is also run with more micro-batches than stages.
    ("gpipe", 2, 4, []),
    ("gpipe", 4, 4, ["--grad-accum", "2", "--split", "1,2,3,2"]),
    ("1f1b", 2, 4, CLIP),
    ("1f1b", 4, 8, []),
    ("interleaved-1f1b", 2, 4, ["--grad-accum", "2"]),
    ("interleaved-1f1b", 4, 4, CLIP),  # 8 stages of one block each
    ("zero-bubble", 2, 2, CLIP),
    ("zero-bubble", 4, 4, ["--grad-accum", "2"]),
    ("zbv", 2, 4, ["--grad-accum", "2"]),
    ("zbv", 4, 8, CLIP),
]


@pytest.mark.parametrize("schedule,nproc,micro_batches,extra", CASES,
                         ids=[f"{s}-x{n}-m{m}{'-' + e[0].strip('-') if e else ''}" for s, n, m, e in CASES])
def test_schedule_matches_single_process(schedule, nproc, micro_batches, extra):
    if schedule == "zbv" and pipeline_train.torch_version() < (2, 13):
        # gloo cannot run ZBV on these releases: the script must say so, once.
        proc, _ = run_script("pipeline_train.py", nproc, ["--schedule", "zbv", "--micro-batches", micro_batches], forked=True)
        assert proc.returncode != 0 and proc.stderr.count("error: --schedule zbv on gloo needs torch 2.13") == 1, proc.stderr[-3000:]
        return
    args = ("--schedule", schedule, "--micro-batches", micro_batches, *extra)
    # The plain run also saves checkpoints, which test_checkpoint resumes from.
    run = launch("pipeline_train.py", nproc, *args) if extra else checkpointed("pipeline_train.py", nproc, *args)[0]
    assert_losses_match(run, reference(*(CLIP if extra == CLIP else [])))
    # Measured: every rank did some of the work, and none all of it.
    assert len(run["busy_pct_per_rank"]) == nproc and all(0 < b < 100 for b in run["busy_pct_per_rank"])
    grad_accum = int(extra[extra.index("--grad-accum") + 1]) if "--grad-accum" in extra else 1
    assert_pipeline_ran(run, nproc, micro_batches, grad_accum)
    split = extra[extra.index("--split") + 1] if "--split" in extra else None
    assert run["blocks_per_rank"] == ([int(c) for c in split.split(",")] if split else [8 // nproc] * nproc)
