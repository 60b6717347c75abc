"""Hybrid pp x dp on 4 ranks must compute the single-process run with every schedule and
every data-parallel wrapper offered, and DDP's replicas must stay identical."""

import pytest

import pipeline_train
from harness import assert_losses_match, assert_pipeline_ran, checkpointed, launch, reference, run_script

CLIP = ["--grad-clip", "0.3"]  # below every step's gradient norm (see test_ddp)
CASES = [
    # pp, dp wrapper, schedule, micro-batches, extra flags (pp=2 gives dp=2 on 4 ranks)
    (4, "fsdp", "1f1b", 4, CLIP),  # dp=1: a pure pipeline through the hybrid script
    (2, "fsdp", "interleaved-1f1b", 2, ["--mesh-order", "dp-pp"]),
    (2, "fsdp", "zero-bubble", 2, CLIP),
    (2, "fsdp", "zbv", 2, ["--grad-accum", "2"]),
    (1, "fsdp", "gpipe", 2, []),  # dp=4: pure FSDP, one stage
    (2, "ddp", "gpipe", 4, CLIP),  # more micro-batches than stages: GPipe's order is not 1F1B's
    (2, "ddp", "1f1b", 2, ["--grad-accum", "2"]),
    (2, "ddp", "interleaved-1f1b", 2, []),
]


@pytest.mark.parametrize("pp,wrapper,schedule,micro_batches,extra", CASES,
                         ids=[f"pp{p}-dp{4 // p}-{w}-{s}{'-' + e[0].strip('-') if e else ''}" for p, w, s, _, e in CASES])
def test_hybrid_matches_single_process(pp, wrapper, schedule, micro_batches, extra):
    args = ["--pp", pp, "--dp-wrapper", wrapper, "--schedule", schedule, "--micro-batches", micro_batches, *extra]
    if schedule == "zbv" and pipeline_train.torch_version() < (2, 13):
        proc, _ = run_script("hybrid_train.py", 4, args, forked=True)  # see test_pipeline: refused on gloo here
        assert proc.returncode != 0 and proc.stderr.count("error: --schedule zbv on gloo needs torch 2.13") == 1, proc.stderr[-3000:]
        return
    # The dp=4 run also saves checkpoints, which test_checkpoint resumes from.
    run = checkpointed("hybrid_train.py", 4, *args)[0] if pp == 1 else launch("hybrid_train.py", 4, *args)
    assert_losses_match(run, reference(*(CLIP if extra == CLIP else [])))
    dp = 4 // pp
    assert run["mesh"] == {"pp": pp, "dp": dp}
    if wrapper == "ddp":
        assert run["dp_replica_max_diff"] == 0.0, "DDP replicas of a stage drifted apart"
    # The mesh's order decides who rank 0's peers are: the inner dimension's ranks are
    # consecutive. Transfers must run among pipeline peers, gradients among replicas.
    inner, outer = ("pp", "dp") if "--mesh-order" in extra and extra[extra.index("--mesh-order") + 1] == "dp-pp" else ("dp", "pp")
    size = {"pp": pp, "dp": dp}
    groups = {inner: list(range(size[inner])), outer: list(range(0, 4, size[inner]))}
    assert run["group_ranks"] == groups
    grad_accum = int(extra[extra.index("--grad-accum") + 1]) if "--grad-accum" in extra else 1
    if pp > 1:
        assert_pipeline_ran(run, pp, micro_batches, grad_accum, pp_group=groups["pp"])
    if dp > 1:  # DDP all-reduces the stage's gradients among replicas; FSDP gathers and reduce-scatters them
        kinds = {"all_reduce"} if wrapper == "ddp" else {"all_gather", "reduce_scatter"}
        assert {e["kind"] for e in run["comm_per_step"] if e["group"] == groups["dp"] and e["bytes"] > 1024} == kinds
