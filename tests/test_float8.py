"""--float8: torchao converts every block's linear (not the head) and the run stays the
same run, within float8's precision, in every strategy. Wherever FSDP shards the blocks
(fsdp, hybrid's stages, tensor parallelism's --dp, context parallelism) it gathers their
weights in float8 and agrees on their scales in one all-reduce a step; DDP and the
pipelines send what they sent without it; sequence-parallel tensor parallelism gathers
its activations in float8. A float8 checkpoint resumes exactly, and into a bf16 run.

torchao's float8 matmul runs on a CPU through torch's reference kernel, ~100x slower
than fp32 at these sizes, so these runs are short: 16-token samples, 2 per step."""

import argparse
import shutil

import pytest
import torch
import torch.nn as nn

import common
from harness import comm, launch, loss_diffs, param_bytes, reference, run_script, simulate

SHORT = ("--seq-len", 16, "--global-batch-size", 2, "--steps", 3)
# e4m3 keeps 3 mantissa bits: each element rounds by up to 2^-4 of itself, and the scale
# comes from the amax of what a rank holds. Ranks holding half the batch scale their
# activations and gradients differently from one process holding it all, so the runs
# agree to float8's precision (measured: ~2e-3 in loss here), not to fp32's 1e-5.
FLOAT8_ATOL = 1e-2


def float8_linears(model):
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def gathers_in_float8(model):
    return all(m.config.enable_fsdp_float8_all_gather for m in model.modules() if type(m).__name__ == "Float8Linear")


def test_every_block_linear_is_converted_and_the_head_is_not():
    args = argparse.Namespace(float8="tensorwise", dtype="fp32", seed=0, activation_checkpointing=False, compile=False)
    cfg = common.PRESETS["tiny"]
    whole = common.build_model(cfg, torch.device("cpu"), args)
    assert len(float8_linears(whole)) == 4 * cfg.n_layers and type(whole.head) is nn.Linear
    # A last pipeline stage: its blocks converted, its head not; FSDP gathers in float8.
    stage = common.build_model(cfg, torch.device("cpu"), args, layers=range(5, 8), embed=False, fsdp=True)
    assert sorted(float8_linears(stage)) == sorted(f"blocks.{i}.{p}" for i in range(5, 8)
                                                   for p in ("attn.qkv", "attn.o", "mlp.fc_in", "mlp.fc_out"))
    assert type(stage.head) is nn.Linear and gathers_in_float8(stage)
    # Per-row scales cannot be gathered as float8 by FSDP; dimensions float8 kernels cannot take stay as they are.
    args.float8 = "rowwise"
    assert not gathers_in_float8(common.build_model(cfg, torch.device("cpu"), args, fsdp=True))
    odd = common.build_model(common.ModelConfig(2, 4, 40, 64, 16, 1e-3), torch.device("cpu"), args)
    assert float8_linears(odd) == []


def test_two_ranks_train_the_single_process_float8_run():
    proc, (single,) = run_script("ddp_train.py", 1, [*SHORT, "--float8", "tensorwise"], torchrun=False, forked=True)
    linears = 4 * common.PRESETS["tiny"].n_layers  # qkv, o, fc_in, fc_out
    assert f"float8 tensorwise: {linears} linears converted; kept in fp32: head" in proc.stdout, proc.stdout
    two = launch("ddp_train.py", 2, *SHORT, "--float8", "tensorwise")
    assert max(loss_diffs(two, single)) < FLOAT8_ATOL
    # The matmuls really ran in float8: the run is near fp32's, not equal to it.
    fp32 = reference(*SHORT)
    assert 1e-4 < max(loss_diffs(single, fp32)) < FLOAT8_ATOL
    # DDP's wire does not change: the fp32 gradients, all-reduced once, and no scale to agree on.
    assert [e["kind"] for e in two["comm_per_step"]] == ["all_reduce"]
    assert comm(two, "all_reduce")[1:] == (param_bytes(two), {"float32"})


def assert_float8_changes_only_the_weight_gathers(run, baseline, group, block_gathers, tp=1, others_unchanged=True):
    """What tensorwise float8 under FSDP (sharding over `group`, rank 0's) changes on the
    wire against the same run without it: each gather of a block moves its matmul weights
    as float8 (one byte an element, viewed as uint8; its norms in the gather's dtype, in the
    same buffer), and one all-reduce a step carries every weight's amax (fp32), from which
    the next step's scales come. Nothing else changes (others_unchanged)."""
    d = common.PRESETS[run["model"]].d_model
    group = tuple(group)
    float8, plain = ({(e["kind"], tuple(e["group"]), e["dtype"]): (e["calls"], e["bytes"]) for e in r["comm_per_step"]}
                     for r in (run, baseline))
    (dtype,) = {dt for kind, g, dt in plain if (kind, g) == ("all_gather", group)}
    width = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    matmul, norms = 12 * d * d // tp, 4 * d  # a block's weights on this tp rank: qkv, o, fc_in, fc_out; two LayerNorms
    calls, nbytes = float8.pop(("all_gather", group, "uint8"), (0, 0))
    assert (calls, nbytes) == (block_gathers, block_gathers * (matmul + norms * width)), (calls, nbytes)
    # The root's gathers (embeddings, head) stay in their dtype.
    root_calls, root_bytes = float8.pop(("all_gather", group, dtype))
    plain_calls, plain_bytes = plain.pop(("all_gather", group, dtype))
    assert (root_calls + calls, root_bytes) == (plain_calls, plain_bytes - calls * (matmul + norms) * width)
    linears = 4 * run["blocks_per_rank"][0] if "blocks_per_rank" in run else 4 * common.PRESETS[run["model"]].n_layers
    reduce_calls, reduce_bytes = float8.pop(("all_reduce", group, "float32"))
    plain_reduce_calls, plain_reduce_bytes = plain.pop(("all_reduce", group, "float32"))
    assert (reduce_calls, reduce_bytes) == (plain_reduce_calls + 1, plain_reduce_bytes + 4 * linears), \
        f"one all-reduce of {linears} amaxes a step, not {reduce_calls - plain_reduce_calls} of {reduce_bytes - plain_reduce_bytes} bytes"
    if others_unchanged:
        assert float8 == plain


def test_context_parallel_gathers_float8_weights():
    # FSDP shards over the whole dp x cp world here: the model must be built for it.
    run = launch("context_parallel_train.py", 2, *SHORT, "--float8", "tensorwise")
    assert 1e-4 < max(loss_diffs(run, reference(*SHORT))) < FLOAT8_ATOL
    blocks = common.PRESETS["tiny"].n_layers
    assert_float8_changes_only_the_weight_gathers(run, launch("context_parallel_train.py", 2, *SHORT), [0, 1], 2 * blocks)


def test_tensor_parallel_under_fsdp_gathers_float8_weights_over_dp():
    # Simulated: gloo cannot all-gather float8, so a real CPU run takes other styles in tp.
    run = simulate("tensor_parallel_train.py", 4, 0, *SHORT, "--dp", 2, "--float8", "tensorwise")
    blocks = common.PRESETS["tiny"].n_layers
    plain = simulate("tensor_parallel_train.py", 4, 0, *SHORT, "--dp", 2)
    assert_float8_changes_only_the_weight_gathers(run, plain, [0, 2], 2 * blocks, tp=2, others_unchanged=False)


def test_fsdp_gathers_float8_weights_and_a_float8_checkpoint_resumes_exactly_and_into_bf16(tmp_path):
    training = [*SHORT, "--steps", 4, "--dtype", "bf16", "--no-reshard-after-forward"]
    args = [*training, "--checkpoint-dir", tmp_path, "--checkpoint-every", 2]
    _, (full,) = run_script("fsdp_train.py", 2, [*args, "--float8", "tensorwise"], forked=True)
    bf16 = launch("fsdp_train.py", 2, "--dtype", "bf16", "--no-reshard-after-forward")  # test_fsdp's, the same weights
    # Block weights travel as float8, half their bf16 bytes; the scales of every weight in one
    # all-reduce a step, beside the gradient norm's. A simulated rank counts the same.
    assert_float8_changes_only_the_weight_gathers(full, bf16, [0, 1], common.PRESETS["tiny"].n_layers)
    assert simulate("fsdp_train.py", 2, 0, *training, "--float8", "tensorwise")["comm_per_step"] == full["comm_per_step"]

    # Resume float8 from step 2: the same steps 3 and 4, exactly.
    shutil.copytree(tmp_path / "step_00000002", tmp_path.parent / "bf16" / "step_00000002")
    shutil.move(tmp_path / "step_00000004", tmp_path.parent / "aside")
    _, (resumed,) = run_script("fsdp_train.py", 2, [*args, "--float8", "tensorwise"], forked=True)
    assert resumed["start_step"] == 2 and resumed["losses"] == full["losses"][2:]
    # Master weights are plain high-precision tensors: a bf16 run continues the same training.
    bf16_args = [a if a != tmp_path else tmp_path.parent / "bf16" for a in args]
    proc, (continued,) = run_script("fsdp_train.py", 2, bf16_args, forked=True)
    assert continued["start_step"] == 2, proc.stdout[-2000:]
    assert max(loss_diffs(continued, resumed)) < FLOAT8_ATOL


def test_tensor_parallel_gathers_activations_in_float8():
    # Simulated: gloo cannot all-gather float8, NCCL and the fake group can.
    run = launch("tensor_parallel_train.py", 1, *SHORT, "--simulate", 2, "--sequence-parallel", "--float8", "tensorwise")
    gathered = {e["dtype"]: e["calls"] for e in run["comm_per_step"] if e["kind"] == "all_gather"}
    blocks = common.PRESETS["tiny"].n_layers
    # Per block, the attention and MLP inputs: forward in e4m3, backward's gradients in e5m2.
    assert gathered["float8_e4m3fn"] == 2 * blocks and gathered["float8_e5m2"] == 2 * blocks, gathered


HYBRID = ("--pp", 2, "--schedule", "gpipe", "--micro-batches", 1)


@pytest.mark.parametrize("script, nproc, extra", [
    ("hybrid_train.py", 4, (*HYBRID, "--float8", "tensorwise")),
    ("pipeline_train.py", 2, ("--schedule", "gpipe", "--micro-batches", 2, "--float8", "tensorwise")),
    ("model_parallel_train.py", 2, ("--float8", "rowwise")),
])
def test_pipelined_stages_convert_what_they_hold(script, nproc, extra):
    run = launch(script, nproc, *SHORT, *extra)
    assert 1e-4 < max(loss_diffs(run, reference(*SHORT))) < FLOAT8_ATOL
    if script == "hybrid_train.py":
        # FSDP over each stage's dp pair gathers its blocks in float8 (kept from forward to
        # backward: once a step), and agrees on the stage's scales in one all-reduce.
        plain = launch(script, nproc, *SHORT, *HYBRID)
        assert_float8_changes_only_the_weight_gathers(run, plain, [0, 1], run["blocks_per_rank"][0])
