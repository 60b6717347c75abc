"""Unit tests of common.py, in this process: the data, the model's split-independent
weights, layer splits and the learning-rate schedule every strategy relies on."""

import argparse
import itertools
import math
import os
import struct
import time

import pytest
import torch

import common
from options import data as token_file

ARGS = argparse.Namespace(seed=0, activation_checkpointing=False, compile=False, float8=None)


def test_a_sample_depends_only_on_seed_and_index():
    data = common.MarkovTokens(512, 32, seed=0)
    x, y = data[5]
    assert torch.equal(x, common.MarkovTokens(512, 32, seed=0)[5][0])  # another worker, another rank
    assert not torch.equal(x, data[6][0]) and not torch.equal(x, common.MarkovTokens(512, 32, seed=1)[5][0])
    assert torch.equal(x[1:], y[:-1])  # targets are the inputs shifted by one
    # Every step follows the chain: the next token is one of this token's 4 successors.
    assert all(int(b) in data.successors[int(a)] for a, b in zip(x, y))


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_ranks_share_out_each_global_batch_exactly(dp_size):
    global_batch, steps = 8, 3
    per_rank = [list(itertools.islice(common.StepSampler(global_batch, r, dp_size, start_step=1), steps * global_batch // dp_size))
                for r in range(dp_size)]
    local = global_batch // dp_size
    for step in range(steps):
        samples = sorted(i for rank in per_rank for i in rank[step * local:(step + 1) * local])
        assert samples == list(range((step + 1) * global_batch, (step + 2) * global_batch))


def test_token_file_windows_and_its_checks(tmp_path):
    path = tmp_path / "train.bin"
    path.write_bytes(struct.pack("<1000H", *(i % 300 for i in range(1000))))  # nanoGPT's format: little-endian uint16
    token_file.check_token_file(str(path), vocab_size=300, seq_len=16)
    data = token_file.TokenFile(str(path), seq_len=16, seed=0)
    x, y = data[3]
    start = int(x[0])  # tokens count up (mod 300), so the first token says where the window starts
    assert torch.equal(x, (torch.arange(start, start + 16) % 300)) and torch.equal(x[1:], y[:-1])
    # Every way the file can be wrong is found before training, whole: the largest id sits last.
    odd, short = tmp_path / "odd.bin", tmp_path / "short.bin"
    odd.write_bytes(b"abc")
    short.write_bytes(struct.pack("<10H", *range(10)))
    # A file of exactly --seq-len + 2 tokens (test_boundaries: one fewer is refused) gives whole windows.
    enough = tmp_path / "enough.bin"
    enough.write_bytes(struct.pack("<18H", *range(18)))
    token_file.check_token_file(str(enough), vocab_size=300, seq_len=16)
    for i in range(20):
        x, y = token_file.TokenFile(str(enough), seq_len=16, seed=0)[i]
        assert torch.equal(x, torch.arange(int(x[0]), int(x[0]) + 16)) and torch.equal(x[1:], y[:-1]) and len(y) == 16
    for bad, vocab, message in [(path, 299, "token id 299, beyond the vocabulary of 299: set --vocab-size 300"),
                                (tmp_path / "missing.bin", 300, "does not exist"), (tmp_path, 300, "is not a file"),
                                (odd, 300, "odd count"), (short, 300, "holds 10 tokens; one sample needs")]:
        with pytest.raises(common.ConfigError, match=message):
            token_file.check_token_file(str(bad), vocab_size=vocab, seq_len=16)


def test_a_stage_gets_exactly_the_whole_models_weights():
    cfg = common.PRESETS["tiny"]
    full = common.build_model(cfg, torch.device("cpu"), ARGS)
    stage = common.build_model(cfg, torch.device("cpu"), ARGS, layers=range(4, 6), embed=False, head=False)
    names = [n for n, _ in stage.named_parameters()]
    assert names and all(n.startswith(("blocks.4.", "blocks.5.")) for n in names)
    for name, p in stage.named_parameters():
        assert torch.equal(p, full.get_parameter(name)), name
    assert sum(p.numel() for p in full.parameters()) == common.count_params(cfg)


def test_layer_splits():
    assert [len(r) for r in common.split_layers(8, 3)] == [3, 3, 2]
    assert common.split_layers(8, 2, [2, 6]) == [range(0, 2), range(2, 8)]
    for n_parts, split in [(9, None), (2, [3, 3]), (3, [2, 6]), (2, [1, 8])]:
        with pytest.raises(common.ConfigError):
            common.split_layers(8, n_parts, split)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    args = argparse.Namespace(lr=1.0, lr_warmup_steps=4, steps=20)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    lrs = [common.set_lr(optimizer, step, args) for step in range(args.steps)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0] and lrs[4] == pytest.approx(1.0)
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:])) and lrs[-1] == pytest.approx(0.1)
    assert optimizer.param_groups[0]["lr"] == lrs[-1]


def test_flops_count_attention_on_top_of_six_per_matmul_weight():
    cfg = common.PRESETS["tiny"]
    matmul_weights = sum(p.numel() for n, p in common.GPT(cfg).named_parameters() if p.dim() == 2 and "emb" not in n)
    assert common.flops_per_token(cfg, 64) == 6 * matmul_weights + 12 * cfg.n_layers * cfg.d_model * 64
    assert math.isclose(common.flops_per_token(common.PRESETS["2.5b"], 1024) / 1e9, 16.6, rel_tol=0.01)


def saved_activation_bytes(model, x):
    """Bytes autograd keeps from the forward pass for backward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t, lambda t: t):
        model(x).sum().backward()
    return sum(saved)


def test_activation_checkpointing_keeps_only_each_blocks_input():
    cfg = common.PRESETS["tiny"]
    x = torch.randint(0, cfg.vocab_size, (2, 32))
    plain = common.build_model(cfg, torch.device("cpu"), ARGS)
    checkpointed = common.build_model(cfg, torch.device("cpu"), argparse.Namespace(**{**vars(ARGS), "activation_checkpointing": True}))
    assert saved_activation_bytes(checkpointed, x) < 0.5 * saved_activation_bytes(plain, x)


def test_compile_compiles_every_block_in_place():
    cfg = common.PRESETS["tiny"]
    model = common.build_model(cfg, torch.device("cpu"), argparse.Namespace(**{**vars(ARGS), "compile": True}))
    assert all(block._compiled_call_impl is not None for block in model.blocks.values())
    assert "blocks.0.attn.qkv.weight" in dict(model.named_parameters())  # names unchanged: checkpoints still match


def test_compile_compiles_the_loss_too(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(fn) or fn)
    assert common.make_loss_fn(ARGS) is common.loss_fn and not compiled
    common.make_loss_fn(argparse.Namespace(**{**vars(ARGS), "compile": True}))
    assert compiled == [common.loss_fn]


@pytest.mark.parametrize("fp16_scaler", [False, True])
def test_the_fused_step_applies_the_clip(fp16_scaler):
    """clip_grad_norm_ hands its factor to the fused AdamW step (fp16's GradScaler
    multiplies its own unscaling in): the update is torch's clip, then an unclipped step."""
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
    ref.load_state_dict(model.state_dict())
    args = argparse.Namespace(lr=1e-2, weight_decay=0.1, float8=None)
    optimizer, ref_optimizer = (common.make_optimizer(m, args) for m in (model, ref))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=fp16_scaler)
    for size in (5.0, 0.01, 5.0):  # norms far above 0.5, then below it (no clip)
        grads = [size * torch.randn_like(p) for p in model.parameters()]
        for p, q, g in zip(model.parameters(), ref.parameters(), grads):
            p.grad, q.grad = scaler.scale(g.clone()), g.clone()
        scaler.unscale_(optimizer)
        norm = common.clip_grad_norm_(optimizer, 0.5)
        scaler.step(optimizer)
        scaler.update()
        assert torch.allclose(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        ref_optimizer.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def data_args(**overrides):
    return argparse.Namespace(**{"data": None, "seq_len": 16, "seed": 0, "global_batch_size": 4, "num_workers": 0, **overrides})


def test_dataloader_workers_run_outside_the_trainers_process_group():
    """--num-workers N starts N worker processes, each in its own process group, so that
    torchrun's SIGTERM to the trainer's group does not kill them mid-step."""
    def children():
        return {int(pid) for pid in open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()}

    def own_group(pid):  # a worker leaves the trainer's group first thing, once it runs
        try:
            return os.getpgid(pid) == pid
        except ProcessLookupError:
            return False

    cfg = common.PRESETS["tiny"]
    before = children()  # the harness's test server may be one
    batches = common.make_batches(data_args(num_workers=2), cfg, torch.device("cpu"), 4)
    next(batches)  # one worker has made a batch; the other may not have been scheduled yet
    workers = sorted(pid for pid in children() - before if "python" in open(f"/proc/{pid}/cmdline").read())
    # Wait for what is checked, not for a time: each worker in a group of its own (30 s is
    # only the bound of a machine too busy to run them at all).
    deadline = time.monotonic() + 30
    while not (len(workers) == 2 and all(map(own_group, workers))) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(workers) == 2 and all(map(own_group, workers)), {pid: os.getpgid(pid) for pid in workers}
    batches.close()


def test_data_file_feeds_the_batches(tmp_path):
    path = tmp_path / "train.bin"
    path.write_bytes(struct.pack("<1000H", *(i % 300 for i in range(1000))))
    x, y = next(common.make_batches(data_args(data=str(path)), common.PRESETS["tiny"], torch.device("cpu"), 4))
    assert x.shape == (4, 16) and torch.equal((x[:, 1:] - x[:, :-1]) % 300, torch.ones(4, 15, dtype=torch.long))


def test_dtype_sets_the_matmul_precision_under_autocast():
    a = torch.randn(4, 4)
    for dtype, expected in [("bf16", torch.bfloat16), ("fp32", torch.float32)]:
        with common.autocast(argparse.Namespace(dtype=dtype), torch.device("cpu")):
            assert (a @ a).dtype == expected


def test_device_cuda_without_a_gpu_is_refused_before_any_process_group():
    with pytest.raises(common.ConfigError, match="--device cuda, but torch sees no GPU"):
        common.init_distributed(argparse.Namespace(device="cuda", dtype=None, timeout=60))
