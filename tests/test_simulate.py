"""--simulate N runs one rank of an N-rank job in one process on a fake process group:
it must do exactly that rank's work (its shards, its stages, its messages), and
run_all.sh's prediction must turn it into the textbook when the inputs are textbook."""

import argparse

import pytest

import pipeline_train
from sweep.predict import comm_seconds, predict, replay
from harness import checkpointed, comm, launch, simulate

CLIP = ("--grad-clip", "0.3")
# A real run of each option that changes what a rank sends or runs, with the arguments
# another test launches it with (so the launch is shared): its rank 0 and a simulated
# rank 0 must count the same collectives, transfers, dtypes and bytes. True: the
# parity test's run that also saves checkpoints.
AS_REAL = [
    ("ddp_train.py", 2, (), True),
    ("ddp_train.py", 2, ("--comm-hook", "fp16"), False),  # the hook's dtype, not the uncompressed bucket
    ("ddp_train.py", 2, ("--comm-hook", "bf16"), False),
    ("ddp_train.py", 2, ("--grad-accum", "2", "--activation-checkpointing"), False),
    ("fsdp_train.py", 2, (), True),
    ("fsdp_train.py", 4, ("--no-reshard-after-forward", "--grad-accum", "2"), False),
    ("fsdp_train.py", 2, ("--cpu-offload", "--activation-checkpointing"), False),
    ("tensor_parallel_train.py", 2, (), True),
    ("tensor_parallel_train.py", 4, ("--sequence-parallel", "--activation-checkpointing"), False),
    ("tensor_parallel_train.py", 4, ("--dp", "2", "--sequence-parallel", "--grad-accum", "2"), False),
    ("model_parallel_train.py", 4, ("--grad-accum", "2", "--activation-checkpointing"), False),
    ("pipeline_train.py", 2, ("--schedule", "gpipe", "--micro-batches", 4), True),
    ("pipeline_train.py", 4, ("--schedule", "1f1b", "--micro-batches", 8), True),
    ("pipeline_train.py", 2, ("--schedule", "interleaved-1f1b", "--micro-batches", 4, "--grad-accum", "2"), False),
    ("pipeline_train.py", 2, ("--schedule", "zero-bubble", "--micro-batches", 2, *CLIP), False),
    ("pipeline_train.py", 2, ("--schedule", "zbv", "--micro-batches", 4, "--grad-accum", "2"), False),
    ("hybrid_train.py", 4, ("--pp", 2, "--dp-wrapper", "ddp", "--schedule", "gpipe", "--micro-batches", 4, *CLIP), False),
    ("hybrid_train.py", 4, ("--pp", 2, "--dp-wrapper", "fsdp", "--schedule", "interleaved-1f1b", "--micro-batches", 2,
                            "--mesh-order", "dp-pp"), False),
    # Zero-bubble's weight gradients, which FSDP then reduce-scatters: every stage of the rank computes them.
    ("hybrid_train.py", 4, ("--pp", 2, "--dp-wrapper", "fsdp", "--schedule", "zero-bubble", "--micro-batches", 2, *CLIP), False),
    ("hybrid_train.py", 4, ("--pp", 2, "--dp-wrapper", "fsdp", "--schedule", "zbv", "--micro-batches", 2, "--grad-accum", "2"), False),
    # FSDP's bf16 policy casts each stage's input: the simulated stage must expect bf16 from its peer.
    ("hybrid_train.py", 4, ("--pp", 2, "--dp-wrapper", "fsdp", "--schedule", "gpipe", "--micro-batches", 2, "--dtype", "bf16"), False),
]


@pytest.mark.parametrize("script,nproc,args,saves", AS_REAL,
                         ids=[f"{s.removesuffix('_train.py')}-x{n}{'-' if a else ''}{'-'.join(str(x).strip('-') for x in a)}" for s, n, a, _ in AS_REAL])
def test_a_simulated_rank_counts_the_bytes_a_real_one_sends(script, nproc, args, saves):
    real = checkpointed(script, nproc, *args)[0] if saves else launch(script, nproc, *args)
    sim = simulate(script, nproc, 0, *args)
    assert sim["simulated_rank"] == 0 and sim["world_size"] == nproc
    assert sim["comm_per_step"] == real["comm_per_step"]
    if "actions_last_step" in real:  # a pipeline's: the same schedule, the same order of work
        assert sim["actions_last_step"] == real["actions_last_step"]


# --dtype bf16, by what each strategy then sends (a simulated rank 0 of 2, or of 4 for
# hybrid): {kind: the dtypes of its entries}.
BF16_ON_THE_WIRE = [
    # Autocast computes in bf16 but keeps fp32 weights: their gradients are all-reduced in fp32.
    ("ddp_train.py", 2, (), {"all_reduce": {"float32"}}),
    # Activations cross in bf16 (test_tensor_parallel counts them), the embeddings' in fp32.
    ("tensor_parallel_train.py", 2, (), {"all_reduce": {"bfloat16", "float32"}}),
    # FSDP gathers bf16 weights, reduces fp32 gradients; the ring passes bf16 keys and
    # values, and sums their gradients in fp32.
    ("context_parallel_train.py", 2, (), {"all_gather": {"bfloat16"}, "reduce_scatter": {"float32"}, "send": {"bfloat16", "float32"}}),
    # Under autocast the residual stream between stages stays fp32 ...
    ("pipeline_train.py", 2, (), {"send": {"float32"}}),
    ("model_parallel_train.py", 2, (), {"send": {"float32"}}),
    ("hybrid_train.py", 4, ("--dp-wrapper", "ddp"), {"send": {"float32"}}),
    # ... but FSDP's policy casts each unit's input, so with FSDP stages it crosses in bf16.
    ("hybrid_train.py", 4, (), {"send": {"bfloat16"}, "all_gather": {"bfloat16"}, "reduce_scatter": {"float32"}}),
]


@pytest.mark.parametrize("script,nproc,args,dtypes", BF16_ON_THE_WIRE,
                         ids=[f"{s.removesuffix('_train.py')}{'-' if a else ''}{'-'.join(a).strip('-')}" for s, _, a, _ in BF16_ON_THE_WIRE])
def test_bf16_crosses_the_wire_where_the_strategy_computes_in_it(script, nproc, args, dtypes):
    run = simulate(script, nproc, 0, "--dtype", "bf16", *args)
    assert {kind: {e["dtype"] for e in run["comm_per_step"] if e["kind"] == kind} for kind in dtypes} == dtypes


@pytest.mark.parametrize("n", [2, 8])
def test_a_simulated_fsdp_rank_holds_one_nth_of_the_training_state(n):
    run = simulate("fsdp_train.py", n, n - 1, "--global-batch-size", 8)
    fp32_params = 4 * run["params"]
    assert run["param_shard_bytes"] == pytest.approx(fp32_params / n, rel=0.02)
    assert run["grad_shard_bytes"] == pytest.approx(fp32_params / n, rel=0.02)
    assert run["optim_shard_bytes"] == pytest.approx(2 * fp32_params / n, rel=0.02)  # Adam's two moments
    assert comm(run, "reduce_scatter", list(range(n)))[1] == fp32_params  # what it contributes to, not what it keeps


def test_a_simulated_pipeline_rank_runs_its_own_part_of_the_schedule():
    # The order each rank ran is the one the replay uses for it, on both ends of the pipe.
    for rank in (0, 3):
        sim = simulate("pipeline_train.py", 4, rank, "--schedule", "1f1b", "--micro-batches", 8)
        assert sim["actions_last_step"] == sim["pipeline_order"][str(rank)]


def equal_stages(orders, stages_per_rank):
    """Replay with every stage equally fast (a forward 1, a backward 2, split over the
    stages a rank holds; zero-bubble's halves 1 each) and free transfers: bubble share."""
    times = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    makespan, busy = replay(orders, lambda rank, kind, stage: times[kind] / stages_per_rank, lambda a, b: 0.0)
    return 1 - sum(busy.values()) / len(busy) / makespan


@pytest.mark.parametrize("schedule,p,m", [("gpipe", 4, 4), ("1f1b", 4, 8), ("1f1b", 2, 2), ("gpipe", 8, 16)])
def test_the_replay_reproduces_the_textbook_bubble(schedule, p, m):
    orders = pipeline_train.pipeline_order(None, argparse.Namespace(schedule=schedule, micro_batches=m), p)
    assert equal_stages(orders, 1) == pytest.approx(pipeline_train.theoretical_bubble_pct(schedule, p, m, 1) / 100)


def test_the_replay_of_torchs_interleaved_order_reproduces_the_interleaved_bubble():
    run = simulate("pipeline_train.py", 2, 0, "--schedule", "interleaved-1f1b", "--micro-batches", 4)
    orders = {int(rank): actions for rank, actions in run["pipeline_order"].items()}
    assert equal_stages(orders, 2) == pytest.approx(pipeline_train.theoretical_bubble_pct("interleaved-1f1b", 2, 4, 2) / 100)


def test_the_replay_charges_each_transfer_and_waits_for_the_slowest_stage():
    orders = pipeline_train.pipeline_order(None, argparse.Namespace(schedule="gpipe", micro_batches=2), 2)
    times = lambda r, kind, stage: {"F": 1.0, "B": 2.0}[kind] * (1 + stage)  # stage 1 twice as slow
    # Each crossing 0.5: F0:0 | (0.5) F1:0 F1:1 B1:0 B1:1 | (0.5) B0:1, B0:0 having run while B1:1 did.
    makespan, busy = replay(orders, times, lambda a, b: 0.5)
    assert makespan == pytest.approx(1 + 0.5 + 2 * 2 + 2 * 4 + 0.5 + 2)
    assert busy == {0: pytest.approx(6.0), 1: pytest.approx(12.0)}
    # A transfer that also holds its sender: rank 1 sends after each backward, so B1:1 starts
    # 0.5 later and B0:1 waits for its send too.
    makespan, _ = replay(orders, times, lambda a, b: 0.5, blocking=True)
    assert makespan == pytest.approx(1 + 0.5 + 2 * 2 + 4 + 0.5 + 4 + 0.5 + 2)


def test_ring_factors_and_the_link_between_nodes():
    bandwidth = (100, 10, 4)  # GB/s inside a node, across nodes; 4 GPUs a node
    inside = {"kind": "all_reduce", "group": [0, 1, 2, 3], "group_size": 4, "bytes": 1e9}
    across = {**inside, "group": [0, 4, 8, 12]}
    assert comm_seconds(inside, bandwidth) == pytest.approx(2 * 3 / 4 * 1e9 / 100e9)
    assert comm_seconds(across, bandwidth) == pytest.approx(2 * 3 / 4 * 1e9 / 10e9)
    gather = {**inside, "kind": "all_gather"}
    assert comm_seconds(gather, bandwidth) == pytest.approx(3 / 4 * 1e9 / 100e9)


def test_the_prediction_hides_what_overlaps_and_exposes_what_cannot():
    bandwidth = (100, 10, 8)
    # 1 s of compute, and an all-reduce that takes 0.75 s on the wire at 100 GB/s over 4 ranks.
    entry = {"kind": "all_reduce", "group": [0, 1, 2, 3], "group_size": 4, "bytes": 50e9, "calls": 10, "dtype": "float32"}

    def run(strategy, **extra):
        return {"strategy": strategy, "world_size": 4, "simulated_rank": 0, "model": "tiny", "config": {}, "step_seconds": 1.0,
                "comm_per_step": [entry], **extra}

    ddp = predict([run("ddp")], bandwidth)
    assert (ddp["low"], ddp["high"]) == (pytest.approx(1.0), pytest.approx(1.75))  # DDP's buckets overlap backward, or not at all
    tp = predict([run("tp", mesh={"dp": 1, "tp": 4})], bandwidth)
    assert (tp["low"], tp["high"]) == (pytest.approx(1.75), pytest.approx(1.75))  # each block waits for its all-reduce
    # Over two nodes of 2 GPUs the same all-reduce runs at the slower link.
    assert predict([run("ddp")], (100, 10, 2))["high"] == pytest.approx(1 + 7.5)
