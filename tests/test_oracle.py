"""An independent oracle for the training arithmetic that every strategy shares.

Every parity test compares a strategy's per-step losses with the single-process
baseline, ddp_train.py at world size 1. That catches a strategy that splits the work
wrongly, but not a bug in code the baseline shares with every strategy: the optimizer
and its parameter groups, the learning-rate schedule, gradient clipping, gradient
accumulation, the loss. Both sides of such a comparison run the same wrong code and
agree. (Review found one: set_lr updated only the first parameter group, and every test
passed.)

The oracle is a plain training loop written out here from textbook definitions. It
shares no training code with the project: its AdamW, schedule, clipping, accumulation
and loss call neither common.py nor torch.optim. From common.py it takes only what
defines the problem, not how it is trained: the model class with its weight init, the
preset's shape and the synthetic data. It runs in this process, on CPU in fp32, and
must reproduce the per-step losses and gradient norms that the baseline, launched as
users launch it, writes in its results line.

The run is chosen so that every piece acts and a mistake in any of them moves a
recorded number. A step's loss and gradient norm are measured before that step's
update, so the record sees every update but the last: a bug that changed only the
final update would go unseen here. The oracle runs in fp32 only, so it cannot see
whether the loss is taken in fp32 under bf16 or fp16 autocast.
"""

import math
from contextlib import contextmanager

import torch

import common
from harness import PARITY_ATOL, reference

# The baseline run. Every setting the oracle relies on is spelled out on the command
# line, not read back from the run's parsed arguments: parsing is shared code too.
MODEL = "tiny"
SEQ_LEN = 32
GLOBAL_BATCH = 8
GRAD_ACCUM = 2  # two micro-batches of 4 per step
# Warm-up over steps 0-1, cosine over steps 2-5. The record sees the updates of steps
# 0-4, so both warm-up values and two cosine values strictly between lr and lr/10.
STEPS = 6
WARMUP = 2
LR = 3e-3
# Ten times the default, so that decay (on the wrong parameters, or none) moves the
# losses clearly and not only the gradient norms: at 0.1 it moved a loss by ~1e-5.
WEIGHT_DECAY = 1.0
GRAD_CLIP = 0.3  # below every step's gradient norm (checked below): clipping acts at every step
SEED = 0
BASELINE_ARGS = ("--model", MODEL, "--seq-len", SEQ_LEN, "--global-batch-size", GLOBAL_BATCH,
                 "--grad-accum", GRAD_ACCUM, "--steps", STEPS, "--lr-warmup-steps", WARMUP, "--lr", LR,
                 "--weight-decay", WEIGHT_DECAY, "--grad-clip", GRAD_CLIP, "--seed", SEED)

# What the project promises beyond its command line (README, make_optimizer, set_lr).
BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
FINAL_LR_FRACTION = 0.1  # the cosine ends at lr/10 on the last step
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ scales by max_norm / (norm + 1e-6), when that is below 1

# Both sides compute in fp32 on CPU and differ only in the order of floating-point
# operations (torch.optim's AdamW against the loop below, F.cross_entropy against
# logsumexp): measured, 5e-7 in a loss and, relative in a gradient norm, 7e-7 on an
# Intel CPU and 1.4e-5 on an AMD EPYC (MKL's kernels differ by CPU, and the difference
# grows with the steps). The tolerances, 1e-5 in a loss (the project's parity
# tolerance) and 1e-4 in a norm, stay above that and well below what a bug in the
# shared code does: each one planted moved a loss by 1e-4 or more, or a gradient norm
# by 2e-3 relative or more. Gradient norms are compared as well because
# clipping and Adam hardly see a gradient's scale: gradients twice too large from
# accumulation left every loss within 5e-7 and doubled every norm.
LOSS_ATOL = PARITY_ATOL
GRAD_NORM_RTOL = 1e-4


def learning_rate(step):
    """Linear warm-up to LR over WARMUP steps (step s gets LR·(s+1)/WARMUP), then half a
    cosine from LR at step WARMUP down to LR·FINAL_LR_FRACTION at the last step."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / (STEPS - 1 - WARMUP)
    floor = LR * FINAL_LR_FRACTION
    return floor + (LR - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def cross_entropy(logits, targets):
    """Mean over tokens of -log softmax(logits)[target], in fp32."""
    logits = logits.float()
    target_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (logits.logsumexp(-1) - target_logits).mean()


def samples(data, first, count):
    """Samples first .. first+count-1, stacked into (inputs, targets)."""
    inputs, targets = zip(*(data[i] for i in range(first, first + count)))
    return torch.stack(inputs), torch.stack(targets)


@contextmanager
def one_thread():
    # On 2 cores shared with the runs other tests launch, torch's two spinning threads
    # made the oracle 40 times slower (14 s against 0.3 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train_oracle():
    """Train the baseline's run by the textbook; return its per-step losses and gradient
    norms (before clipping), as the results line records them."""
    cfg = common.PRESETS[MODEL]
    model = common.GPT(cfg)
    model.init_weights(SEED)
    data = common.MarkovTokens(cfg.vocab_size, SEQ_LEN, SEED)
    params = list(model.parameters())
    exp_avg = [torch.zeros_like(p) for p in params]  # AdamW's first moment
    exp_avg_sq = [torch.zeros_like(p) for p in params]  # and its second
    micro_batch = GLOBAL_BATCH // GRAD_ACCUM
    losses, grad_norms = [], []

    for step in range(STEPS):
        # Step s's global batch is samples [s·G, (s+1)·G), in order, one micro-batch at a
        # time. Each micro-batch's mean loss is divided by the number of micro-batches,
        # so the summed gradients (and losses) are those of the global batch's mean.
        grads = [torch.zeros_like(p) for p in params]
        loss_sum = 0.0
        for micro in range(GRAD_ACCUM):
            x, y = samples(data, step * GLOBAL_BATCH + micro * micro_batch, micro_batch)
            loss = cross_entropy(model(x), y) / GRAD_ACCUM
            for total, grad in zip(grads, torch.autograd.grad(loss, params)):
                total += grad
            loss_sum += loss.item()
        losses.append(loss_sum)

        # Clip by the norm over ALL gradients together, never each on its own.
        norm = torch.stack([(g * g).sum() for g in grads]).sum().sqrt().item()
        grad_norms.append(norm)
        scale = GRAD_CLIP / (norm + CLIP_EPS)
        if scale < 1:
            grads = [g * scale for g in grads]

        # AdamW (Loshchilov & Hutter): bias-corrected moments; weight decay decoupled from
        # the gradient and applied to matrices only (dim >= 2), not to norms and biases.
        lr, t = learning_rate(step), step + 1
        beta1, beta2 = BETAS
        with torch.no_grad():
            for p, g, m, v in zip(params, grads, exp_avg, exp_avg_sq):
                if p.dim() >= 2:
                    p -= lr * WEIGHT_DECAY * p
                m.mul_(beta1).add_((1 - beta1) * g)
                v.mul_(beta2).add_((1 - beta2) * g * g)
                m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
                p -= lr * m_hat / (v_hat.sqrt() + ADAM_EPS)
    return losses, grad_norms


def test_baseline_trains_as_the_textbook_says():
    # The run must exercise what it checks. Clipping that never acted would hide a bug in
    # it; cosine steps after the last seen update would hide one in the schedule.
    assert 0 < WARMUP and WARMUP + 1 < STEPS - 1, "the record must see warm-up and a cosine step strictly inside"
    baseline = reference(*BASELINE_ARGS)
    assert len(baseline["losses"]) == len(baseline["grad_norms"]) == STEPS
    assert min(baseline["grad_norms"]) > GRAD_CLIP, f"--grad-clip {GRAD_CLIP} must be below every gradient norm: {baseline['grad_norms']}"

    with one_thread():
        losses, grad_norms = train_oracle()
    loss_diffs = [abs(a - b) for a, b in zip(losses, baseline["losses"])]
    norm_diffs = [abs(a - b) / b for a, b in zip(grad_norms, baseline["grad_norms"])]
    assert max(loss_diffs) <= LOSS_ATOL and max(norm_diffs) <= GRAD_NORM_RTOL, (
        f"the baseline departs from the textbook oracle by up to {max(loss_diffs):.1e} in a loss "
        f"(atol {LOSS_ATOL:.0e}) and {max(norm_diffs):.1e} relative in a gradient norm (rtol {GRAD_NORM_RTOL:.0e}):\n"
        f"  losses     baseline {baseline['losses']}\n             oracle   {losses}\n"
        f"  grad norms baseline {baseline['grad_norms']}\n             oracle   {grad_norms}")
