"""What every plain training run uses: the model, the data, the command line, processes
and devices, the optimizer, and the step log with its results line. Each strategy is its
own *_train.py; copy one with this file for a working job. What only a flag turns on
lives in options/, one module a flag, imported only when the flag is on."""

import argparse
import importlib
import itertools
import json
import math
import os
import random
import re
import resource
import signal
import sys
import tempfile
import threading
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset, Sampler

# torchrun sets RANK before the process starts, so this is fixed for the process's life.
RANK = int(os.environ.get("RANK", "0"))
IS_MAIN = RANK == 0


def log(*parts):
    """Print on rank 0 only: N ranks printing the same line helps nobody."""
    if IS_MAIN:
        print(*parts, flush=True)


_said = set()


def log_once(message):
    """log(), but a message that several stages or modules would repeat appears once."""
    if message not in _said:
        _said.add(message)
        log(message)


class ConfigError(Exception):
    """A configuration the job cannot run: every rank reaches it and exits; rank 0 says why."""


class OutputError(Exception):
    """An output this rank cannot write: it says so itself."""


class NonFiniteLoss(Exception):
    pass


def check(ok, message):
    if not ok:
        raise ConfigError(message)


# ----------------------------------------------------------------------------
# What only a flag turns on: options/<module>.py, imported once the flag is seen
# ----------------------------------------------------------------------------

# A module may define check_args(args, cfg), which parse_args runs.
OPTION_MODULES = {"--data": "data", "--simulate": "simulate", "--count-comm": "count_comm", "--float8": "float8",
                  "--checkpoint-dir": "checkpoint", "--profile": "profile", "--tensorboard": "tensorboard"}


def option(name):  # the module options/<name>.py
    return importlib.import_module(f"options.{name}")


class StepHook:
    """What TrainLog calls around each step (counted from 1, as in the log): the options'
    modules are StepHooks. Time spent in after_step is no step's."""

    untimed_steps = 0  # steps after --timing-warmup-steps that its work slows (the profiler's)
    slows_last_step = False  # it instruments the last step: left out of throughput

    def before_step(self, step):
        pass

    def before_agreement(self, step, loss):  # returns this rank's loss, before the ranks agree on it
        return loss

    def after_step(self, step, metrics, stop):  # stop: the job ends after this step
        pass

    def results(self):  # fields for the results line
        return {}


# ----------------------------------------------------------------------------
# Model: a GPT-style decoder that every strategy uses unchanged
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    n_heads: int
    d_model: int
    vocab_size: int
    max_seq_len: int
    lr: float  # default peak learning rate: GPT-3's for the sizes it trained, higher for tiny


PRESETS = {
    # CPU and tests: 8 blocks so 4 pipeline ranks can hold 2 stages each, 4 heads for 4-way TP.
    "tiny": ModelConfig(n_layers=8, n_heads=4, d_model=64, vocab_size=512, max_seq_len=64, lr=3e-3),
    # GPT-2 medium shape: trains comfortably on one GPU.
    "350m": ModelConfig(n_layers=24, n_heads=16, d_model=1024, vocab_size=32000, max_seq_len=1024, lr=3e-4),
    # The article's 2.5B-parameter Transformer: 2.52B in the blocks, 2.68B in all.
    "2.5b": ModelConfig(n_layers=32, n_heads=20, d_model=2560, vocab_size=32000, max_seq_len=1024, lr=1.6e-4),
    # GPT-3 6.7B: fp32 Adam needs ~107 GB. One H200 holds DDP at batch 8, FSDP+offload at 16 (74 GiB).
    "6.7b": ModelConfig(n_layers=32, n_heads=32, d_model=4096, vocab_size=32000, max_seq_len=1024, lr=1.2e-4),
}
# 2.5b with a position table of 128k tokens, for long sequences (context parallelism).
PRESETS["2.5b-long"] = replace(PRESETS["2.5b"], max_seq_len=131072)


def causal_attention(q, k, v):  # each token sees itself and those before it; (B, heads, T, head_dim)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_heads
        # q, k and v in one matmul (one input cast, one input gradient), features grouped by
        # head ([q k v] of head 0, of head 1, ...): tensor parallelism hands out whole heads.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.attention = causal_attention  # context parallelism swaps in its ring attention

    def forward(self, x):
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds n_heads / tp. Split before the
        # transpose, so backward joins the three gradients into qkv's layout in one copy.
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(B, T, -1, 3 * self.head_dim).split(self.head_dim, dim=-1))
        y = self.attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.fc_out = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x):
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))


class Block(nn.Module):  # pre-LayerNorm
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only Transformer, or a consecutive slice of one: blocks keyed by global index
    (one name on every stage and checkpoint), embeddings and head optional, the head untied
    (tying would couple the first and last pipeline stages)."""

    def __init__(self, cfg, layers=None, embed=True, head=True):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab_size, d) if embed else None
        self.pos_emb = nn.Embedding(cfg.max_seq_len, d) if embed else None
        layers = range(cfg.n_layers) if layers is None else layers
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = nn.LayerNorm(d) if head else None
        self.head = nn.Linear(d, cfg.vocab_size, bias=False) if head else None
        self.activation_checkpointing = False

    def forward(self, x, positions=None):
        """positions: each token's place in the sequence, where x holds part of it (context parallelism)."""
        if self.tok_emb is not None:
            positions = torch.arange(x.shape[1], device=x.device) if positions is None else positions
            x = self.tok_emb(x) + self.pos_emb(positions)
        for block in self.blocks.values():
            if self.activation_checkpointing:
                # Keep only each block's input; recompute its inside during backward.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x

    @torch.no_grad()
    def init_weights(self, seed):
        """GPT-2 init, each part (embeddings 0, block i i + 1, head n_layers + 1) from its own
        generator: a stage holding blocks 8-15 gets exactly the whole model's weights there."""
        parts = [(0, [self.tok_emb, self.pos_emb])] if self.tok_emb is not None else []
        parts += [(int(i) + 1, [b]) for i, b in self.blocks.items()]
        parts += [(self.cfg.n_layers + 1, [self.norm, self.head])] if self.head is not None else []
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        device = next(self.parameters()).device
        for part, modules in parts:
            gen = torch.Generator(device).manual_seed(seed * 1_000_003 + part)
            for module in modules:
                for pname, p in module.named_parameters():
                    if isinstance(module, nn.LayerNorm) or "norm" in pname:
                        nn.init.ones_(p) if pname.endswith("weight") else nn.init.zeros_(p)
                    else:
                        std = residual_std if pname.endswith(("o.weight", "fc_out.weight")) else 0.02
                        nn.init.normal_(p, 0.0, std, generator=gen)


def split_layers(n_layers, n_parts, split=None):
    """Consecutive block ranges, one per part (ranks, stages): even, or as --split 3,5 gives them."""
    if split:
        given = ",".join(map(str, split))
        check(len(split) == n_parts, f"--split {given} names {len(split)} parts, but there are {n_parts}")
        check(sum(split) == n_layers, f"--split {given} must give every part at least one block and {n_layers} in all")
        counts = split
    else:
        check(n_parts <= n_layers, f"{n_parts} pipeline stages but only {n_layers} blocks: use fewer ranks or stages, or a deeper model")
        counts = [n_layers // n_parts + (i < n_layers % n_parts) for i in range(n_parts)]
    starts = [sum(counts[:i]) for i in range(n_parts)]
    return [range(s, s + c) for s, c in zip(starts, counts)]


def count_params(cfg, layers=None, embed=True, head=True):
    """Parameters of the model, or of the slice build_model(..., layers, embed, head) builds."""
    d, V = cfg.d_model, cfg.vocab_size
    n_layers = cfg.n_layers if layers is None else len(layers)
    block = 12 * d * d + 4 * d  # qkv, o, MLP in and out; two LayerNorms' weight and bias
    return (V * d + cfg.max_seq_len * d) * embed + n_layers * block + (2 * d + d * V) * head


def check_fits(cfg, device, layers=None, embed=True, head=True):
    """Refuse, before allocating, fp32 weights beyond the device's memory (the host's on a CPU)."""
    weight_bytes = 4 * count_params(cfg, layers, embed, head)
    if device.type == "cuda":
        capacity, where = torch.cuda.get_device_properties(device).total_memory, f"this GPU's {torch.cuda.get_device_name(device)}"
    else:
        capacity, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's"
    check(weight_bytes < capacity, f"the model (vocabulary {cfg.vocab_size}, d_model {cfg.d_model}, {cfg.n_layers} layers) needs "
          f"{weight_bytes / 2**30:.4g} GiB for its fp32 weights here, more than {where} {capacity / 2**30:.0f} GiB: "
          "a smaller --model or --vocab-size, or a strategy that splits the model")


def compile_blocks(model):
    """torch.compile each block in place: names unchanged, every strategy wraps the same modules."""
    for block in model.blocks.values():
        block.compile()


def build_model(cfg, device, args, layers=None, embed=True, head=True, fsdp=False, defer_compile=False):
    """(A slice of) the model, built on `device` with its --seed weights, --float8 (fsdp: the
    caller shards it next), --activation-checkpointing and --compile (defer_compile: the
    caller compiles the blocks once its own parallelism is on them)."""
    check_fits(cfg, device, layers, embed, head)
    with torch.device(device):
        model = GPT(cfg, layers, embed, head)
    model.init_weights(args.seed)
    if args.float8:
        option("float8").convert(model, args, device, fsdp)
    model.activation_checkpointing = args.activation_checkpointing
    if args.compile and not defer_compile:
        compile_blocks(model)
    return model


def flops_per_token(cfg, seq_len):
    """Training FLOPs per token, 6N + 12·L·d·T (PaLM appendix B): N the matmul weights, embeddings not."""
    n_matmul = cfg.n_layers * 12 * cfg.d_model**2 + cfg.d_model * cfg.vocab_size
    return 6 * n_matmul + 12 * cfg.n_layers * cfg.d_model * seq_len


def loss_fn(logits, targets):
    """Mean next-token cross entropy in fp32: log_softmax reads bf16 logits, writes fp32, in one kernel."""
    log_probs = F.log_softmax(logits.flatten(0, 1), dim=-1, dtype=torch.float32)
    return F.nll_loss(log_probs, targets.flatten())


def make_loss_fn(args):
    """loss_fn, compiled under --compile (fused: fewer passes over tokens x vocabulary in fp32)."""
    return torch.compile(loss_fn) if args.compile else loss_fn


# ----------------------------------------------------------------------------
# Data: a deterministic synthetic stream (--data FILE: options/data.py)
# ----------------------------------------------------------------------------


class MarkovTokens(Dataset):
    """Sample i depends only on (seed, i), so every strategy trains on the same batches; each
    token has 4 equally likely successors, so the loss falls towards ln(4) = 1.386."""

    branching = 4

    def __init__(self, vocab_size, seq_len, seed):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed
        rng = random.Random(f"markov:{seed}")
        self.successors = [[rng.randrange(vocab_size) for _ in range(self.branching)] for _ in range(vocab_size)]

    def __getitem__(self, i):
        rng = random.Random(f"{self.seed}:{i}")
        choices = rng.getrandbits(2 * (self.seq_len + 1))  # 2 bits pick 1 of 4 successors
        token = rng.randrange(self.vocab_size)
        tokens = []
        for _ in range(self.seq_len + 1):
            tokens.append(token)
            token = self.successors[token][choices & 3]
            choices >>= 2
        t = torch.tensor(tokens)
        return t[:-1], t[1:]


class StepSampler(Sampler):
    """Step s's global batch is samples [s·G, (s+1)·G); data-parallel rank r of D takes the
    r-th contiguous G/D of them; a resumed run starts at its `start_step`."""

    def __init__(self, global_batch_size, dp_rank, dp_size, start_step):
        self.global_batch_size, self.dp_rank, self.dp_size, self.start_step = global_batch_size, dp_rank, dp_size, start_step

    def __iter__(self):
        local = self.global_batch_size // self.dp_size
        for step in itertools.count(self.start_step):
            first = step * self.global_batch_size + self.dp_rank * local
            yield from range(first, first + local)


def _leave_process_group(worker_id):
    # torchrun's SIGTERM to the trainer's process group must not kill its workers mid-step
    # (it could not checkpoint): they end with it, or see it gone (DataLoader's watchdog).
    os.setpgid(0, 0)
    # A batch handed over as the trainer exits would print a traceback under its one line.
    excepthook = sys.excepthook
    sys.excepthook = lambda kind, e, tb: None if issubclass(kind, (ConnectionError, EOFError)) else excepthook(kind, e, tb)


def make_batches(args, cfg, device, batch_size, dp_rank=0, dp_size=1, start_step=0):
    """An endless iterator of (inputs, targets) on `device`, `batch_size` samples each."""
    if args.data:
        dataset = option("data").TokenFile(args.data, args.seq_len, args.seed)
    else:
        dataset = MarkovTokens(cfg.vocab_size, args.seq_len, args.seed)
    # No persistent_workers (the article's advice): this loader has no epochs to re-create them at.
    loader = DataLoader(dataset, batch_size=batch_size, sampler=StepSampler(args.global_batch_size, dp_rank, dp_size, start_step),
                        num_workers=args.num_workers, worker_init_fn=_leave_process_group,
                        pin_memory=device.type == "cuda")  # page-locked host memory: faster, async copies
    return ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def number(cast, low, high=math.inf, low_open=False, accepted=""):
    """argparse type: a finite `cast` in [low, high] (above low if low_open); refusals say what is accepted."""

    def parse(text):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not (value > low if low_open else value >= low) or value > high:
            raise argparse.ArgumentTypeError(f"{text!r} is not {accepted}")
        return value

    return parse


positive = number(int, 1, accepted="a whole number of at least 1")
non_negative = number(int, 0, accepted="a whole number of at least 0")
positive_float = number(float, 0, low_open=True, accepted="a finite number above 0")
non_negative_float = number(float, 0, accepted="a finite number of at least 0")


def block_counts(text):
    """argparse type for --split: blocks per part, e.g. 3,5."""
    try:
        counts = [int(c) for c in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of block counts of at least 1, such as 3,5")
    return counts


class _Parser(argparse.ArgumentParser):
    """--help and usage errors from rank 0 only, an error in one line like every refusal."""

    def _print_message(self, message, file=None):
        if IS_MAIN:
            super()._print_message(message, file)

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def base_parser(doc):
    """The arguments every script shares; a script adds its own and calls parse_args()."""
    p = _Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and data")
    g.add_argument("--model", choices=PRESETS, default="tiny", help="size preset (default: tiny, the CPU/test size; 2.5b is the article's model)")
    g.add_argument("--vocab-size", type=positive, help="override the preset's vocabulary (needed when --data holds larger token ids)")
    g.add_argument("--seq-len", type=positive, help="tokens per sample (default: the preset's context length)")
    g.add_argument("--data", metavar="FILE", help="flat binary file of uint16 token ids, as nanoGPT's train.bin (default: synthetic Markov data)")
    g.add_argument("--num-workers", type=non_negative, default=2, help="DataLoader worker processes per rank (default: 2; 0 loads in the training process)")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=positive, default=20, help="optimizer steps (default: 20)")
    g.add_argument("--global-batch-size", type=positive, default=8, help="samples per optimizer step, summed over all ranks and micro-steps (default: 8)")
    g.add_argument("--grad-accum", type=positive, default=1, help="micro-steps per optimizer step on each data-parallel rank (default: 1)")
    g.add_argument("--lr", type=positive_float, help="peak learning rate (default: the preset's, 1.6e-4 for 2.5b)")
    g.add_argument("--lr-warmup-steps", type=non_negative, default=2, help="linear warm-up steps before cosine decay to lr/10; at most --steps (default: 2)")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.1, help="AdamW weight decay on matrices (default: 0.1)")
    g.add_argument("--grad-clip", type=non_negative_float, default=1.0, help="clip the global gradient norm to this; 0 disables (default: 1.0)")
    g.add_argument("--seed", type=number(int, 0, 2**32 - 1, accepted="a whole number from 0 to 4294967295"), default=0, help="seed for weights and data (default: 0)")
    g.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="compute dtype under autocast; weights and optimizer stay fp32 (default: bf16 on GPUs that have it, else fp32)")
    g.add_argument("--activation-checkpointing", action="store_true", help="recompute each block in backward instead of storing its activations")
    g.add_argument("--compile", action="store_true", help="torch.compile each Transformer block and the loss (tensor parallel: the blocks only, see README)")
    g.add_argument("--float8", choices=["tensorwise", "rowwise"], help="the blocks' matmuls in float8 (torchao), scaled per tensor or row (Hopper+, with --compile; README)")
    g = p.add_argument_group("system")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA with NCCL where there is a GPU, else CPU with gloo")
    g.add_argument("--timeout", type=number(float, 1, 7 * 86400, accepted="a number of seconds from 1 to 604800 (a week)"), default=600,
                   help="seconds a collective waits for a peer, and a step may take, before the job fails (default: 600)")
    g.add_argument("--simulate", type=number(int, 2, 4096, accepted="a number of ranks from 2 to 4096"), metavar="N", help="run as one rank of an "
                   "N-rank job on this device (a fake process group): its compute and memory real, its communication counted (README)")
    g.add_argument("--simulate-rank", type=non_negative, default=0, metavar="R", help="with --simulate: the rank to be (default: 0)")
    g.add_argument("--count-comm", action="store_true", help="count the last step's collectives into the results line (that step is not timed)")
    g = p.add_argument_group("output")
    g.add_argument("--log-every", type=positive, default=1, help="print a step line every N steps (default: 1)")
    g.add_argument("--timing-warmup-steps", type=non_negative, help="first steps left out of throughput; below --steps (default: 3 or fewer)")
    g.add_argument("--profile", metavar="DIR", help="trace a few steps with torch.profiler into DIR and print the op table")
    g.add_argument("--tensorboard", metavar="DIR", help="log loss, lr, step time, tokens/s, MFU and memory every step into DIR for TensorBoard (rank 0)")
    g.add_argument("--results", metavar="FILE", help="append one JSON line with this run's figures to FILE")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here (always after the last step), and resume from the newest one that loads")
    g.add_argument("--checkpoint-every", type=non_negative, default=0, help="with --checkpoint-dir, also save every N steps (default: 0: only after the last step and on SIGTERM)")
    return p


def parse_args(parser):
    """Parse and check every option, file and folder before any process group or model exists
    (ConfigError: one line). Returns (args, the model's config), defaults filled in."""
    args = parser.parse_args()
    cfg = PRESETS[args.model]
    if args.vocab_size is not None:
        cfg = replace(cfg, vocab_size=args.vocab_size)
    args.seq_len = cfg.max_seq_len if args.seq_len is None else args.seq_len
    args.lr = cfg.lr if args.lr is None else args.lr
    if args.timing_warmup_steps is None:
        args.timing_warmup_steps = min(3, args.steps - 1)
    args.count_comm = args.count_comm or bool(args.simulate)  # what a simulated rank predicts from
    check(args.seq_len <= cfg.max_seq_len, f"--seq-len {args.seq_len} exceeds the {args.model} preset's context of {cfg.max_seq_len}")
    check(args.lr_warmup_steps <= args.steps, f"--lr-warmup-steps {args.lr_warmup_steps} must be at most --steps {args.steps}")
    check(args.timing_warmup_steps < args.steps, f"--timing-warmup-steps {args.timing_warmup_steps} leaves no step of --steps "
          f"{args.steps} to time: it must be below --steps")
    check(not args.checkpoint_every or args.checkpoint_dir, "--checkpoint-every needs --checkpoint-dir DIR to save into")
    check(args.simulate or not args.simulate_rank, "--simulate-rank needs --simulate N")
    for flag, name in OPTION_MODULES.items():
        if getattr(args, flag.removeprefix("--").replace("-", "_")):
            check(os.path.exists(os.path.join(os.path.dirname(os.path.abspath(__file__)), "options", f"{name}.py")),
                  f"{flag} needs options/{name}.py beside common.py: copy it from the repository's options/ folder")
            try:
                module = option(name)
            except ImportError as e:  # torchao, tensorboard
                raise ConfigError(f"{flag} needs what options/{name}.py imports: {e} (pip install -r requirements.txt)") from None
            if hasattr(module, "check_args"):
                module.check_args(args, cfg)
    if args.results and IS_MAIN:  # only rank 0 writes it: opened now, so that one it cannot take fails before training
        folder = os.path.dirname(os.path.abspath(args.results))
        check(os.path.isdir(folder), f"--results {args.results}: the folder {folder} does not exist")
        check(not os.path.isdir(args.results), f"--results {args.results} is a folder: give a file to append the results line to")
        check(not os.path.exists(args.results) or os.path.isfile(args.results), f"--results {args.results} is not a regular file")
        try:
            open(args.results, "a").close()
        except OSError as e:
            raise ConfigError(f"--results {args.results} cannot be appended to: {e.strerror or e}") from None
    return args, cfg


def check_folder(flag, path):
    """A folder every rank writes into: made if missing and written to once, or refused."""
    check(not os.path.exists(path) or os.path.isdir(path), f"{flag} {path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be {'written' if os.path.isdir(path) else 'made'}: {e.strerror or e}") from None


# ----------------------------------------------------------------------------
# Processes and devices
# ----------------------------------------------------------------------------


@dataclass
class Env:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    fake: bool = False  # a fake process group (--simulate): collectives move nothing, the peers exist nowhere


def init_distributed(args, cpu_collectives=False):
    """Bind to a device and join the process group (torchrun's env://; a world of one without
    it; a fake world under --simulate); settles args.dtype. cpu_collectives: gloo beside NCCL."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        check(torch.cuda.is_available(), "--device cuda, but torch sees no GPU")
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check(local_ranks <= torch.cuda.device_count(), f"{local_ranks} processes on this node but {torch.cuda.device_count()} GPU(s): "
              "NCCL needs one GPU per rank (lower --nproc_per_node, or --device cpu)")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # fp32 matmuls on tensor cores (TF32)
    else:
        device = torch.device("cpu")
    if args.dtype is None:
        args.dtype = "bf16" if use_cuda and torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
    check(not (args.dtype == "fp16" and not use_cuda), "--dtype fp16 needs a GPU; use fp32 or bf16 on the CPU")
    timeout = timedelta(seconds=args.timeout)
    backend = ("cuda:nccl,cpu:gloo" if cpu_collectives else "nccl") if use_cuda else "gloo"
    if args.simulate:
        option("simulate").init_process_group(args, device)
        return Env(args.simulate_rank, args.simulate, local_rank, device, fake=True)
    if "RANK" in os.environ:
        # device_id binds NCCL's communicator to this GPU at once (no guessing, no hang).
        dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
        # All join before any leaves: one refusing the configuration must not cut a slow joiner off.
        dist.barrier()
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Env(dist.get_rank(), dist.get_world_size(), local_rank, device)


def make_mesh(env, **dims):
    """A script's DeviceMesh: make_mesh(env, pp=2, dp=4); the last dimension's ranks share a node."""
    shape = tuple(dims.values())
    check(math.prod(shape) == env.world_size, f"mesh {' x '.join(f'{k}={v}' for k, v in dims.items())} needs {math.prod(shape)} ranks, but the world has {env.world_size}")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(env.device.type, shape, mesh_dim_names=tuple(dims))


def autocast(args, device):
    if args.dtype == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float16)


def refuse_fp16(args, why):
    check(args.dtype != "fp16", f"--dtype fp16 is not supported here: {why}; use bf16 (or fp32 on GPUs without bf16)")


# ----------------------------------------------------------------------------
# Optimizer, learning rate, gradient clipping
# ----------------------------------------------------------------------------


def make_optimizer(model, args):
    """AdamW, decay on matrices only, fused on CPU and CUDA alike (the tests run the GPU's
    update and clipping). Any other torch.optim optimizer works too (clip_grad_norm_)."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)
    if args.float8:  # under FSDP, its scales are computed after each step, in one all-reduce
        option("float8").scales_after_each_step(optimizer, model)
    return optimizer


def set_lr(optimizer, step, args):
    """Linear warm-up, then cosine decay to lr/10 at the last step (the article's
    large-batch advice). A pure function of the step, so resuming needs only the step."""
    if step < args.lr_warmup_steps:
        lr = args.lr * (step + 1) / args.lr_warmup_steps
    else:
        progress = (step - args.lr_warmup_steps) / max(1, args.steps - 1 - args.lr_warmup_steps)
        lr = args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def clip_grad_norm_(optimizer, max_norm, group=None):
    """Clip by the norm over the WHOLE model; returns it. DTensor gradients reduce over their
    mesh, `group` over ranks holding other parts (pipeline stages). A fused optimizer divides
    by `optimizer.grad_scale` (GradScaler's hook) as it updates, sparing a pass over every
    gradient (2.5b: 10 GB); any other gets torch's clip_grads_with_norm_."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params]).float()
    if "torch.distributed.tensor" in sys.modules and isinstance(total, sys.modules["torch.distributed.tensor"].DTensor):
        total = total.full_tensor()  # (importing DTensor costs a second a process: only where one was made)
    if group is not None:
        total_sq = total**2
        dist.all_reduce(total_sq, group=group)
        total = total_sq.sqrt()
    if max_norm > 0 and optimizer.defaults.get("fused"):
        # The same factor as clip_grads_with_norm_, max_norm / (total + 1e-6) when below 1, inverted.
        optimizer.grad_scale = torch.clamp((total + 1e-6) / max_norm, min=1.0)
    elif max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


# ----------------------------------------------------------------------------
# Running a script: one clear line on rank 0, not a traceback from every rank
# ----------------------------------------------------------------------------


def _lost_peer(e):
    """A collective failed because a peer is gone or silent: a timeout or broken connection
    raised inside torch.distributed (gloo's are plain RuntimeErrors)."""
    tb = e.__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    in_distributed = f"{os.sep}torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename
    return isinstance(e, dist.DistError) or (in_distributed and re.search(r"[Tt]imed out|[Cc]onnection|by peer", str(e)) is not None)


_exiting = threading.Event()  # set once run() handles the end, so the Watchdog stays quiet


def _one_line(e):
    """Say in one line why the run ends and return its exit status, or re-raise (a bug)."""
    if isinstance(e, (ConfigError, NonFiniteLoss)):  # every rank alike: rank 0 speaks for all
        if IS_MAIN:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 3
    if isinstance(e, KeyboardInterrupt):
        if IS_MAIN:
            print("interrupted", file=sys.stderr, flush=True)
        return 130
    if isinstance(e, BrokenPipeError):  # `... | head`: the reader left, so nobody is listening
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own exit flush would fail again
        return 1
    if isinstance(e, OutputError):
        message = str(e)
    elif isinstance(e, torch.OutOfMemoryError):
        message = (f"rank {RANK} ran out of memory ({str(e).splitlines()[0][:120]}): try --activation-checkpointing, "
                   "a smaller --global-batch-size or more --grad-accum, or a strategy that shards the model")
    elif isinstance(e, (dist.DistError, RuntimeError)) and _lost_peer(e):
        reason = re.sub(r"^\[[^\]]*\] ", "", str(e).strip().splitlines()[0])  # drop gloo's source location
        message = f"rank {RANK} lost a peer ({reason}): another rank died or stalled past --timeout; its log says why"
    else:
        raise e
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


def run(main):
    """Run a script's main(), failures a user can act on said in one line. Every way out ends
    this process (its DataLoader workers with it); the Watchdog ends one whose steps stall."""
    code, finished = 0, False
    try:
        main()
        finished = True
    except (Exception, KeyboardInterrupt) as e:  # SystemExit (argparse's) goes its own way
        _exiting.set()
        code = _one_line(e)
    finally:
        _exiting.set()
        if not finished and any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
            # A checkpoint being written behind training: Python would wait for its thread, up
            # to a --timeout if its peers are gone. It is not committed; the one before stays.
            if code == 0 and sys.exc_info()[0] is not None:
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code or 1)
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(code)


class Watchdog:
    """Ends the process after --timeout seconds without progress: a collective times out only
    while a live peer waits, this also when every rank is stuck (a deadlock, a hung device)."""

    def __init__(self, seconds):
        self.seconds, self.last, self.where = seconds, time.monotonic(), "the start of training"
        threading.Thread(target=self._watch, daemon=True, name="watchdog").start()

    def progress(self, where):
        self.last, self.where = time.monotonic(), where

    def stop(self):
        self.last = None

    def _watch(self):
        while True:
            time.sleep(min(1.0, self.seconds / 10))
            last = self.last
            if last is None or _exiting.is_set():
                return
            if time.monotonic() - last > self.seconds:
                if IS_MAIN:  # every stuck rank ends; rank 0 says why (a live one reports a lost peer)
                    print(f"error: no progress for {self.seconds:g} s after {self.where} (--timeout): a rank is stuck; "
                          "if a step really takes this long, raise --timeout", file=sys.stderr, flush=True)
                os._exit(1)


# ----------------------------------------------------------------------------
# The step log: metrics, the results line, and the hooks around each step
# ----------------------------------------------------------------------------

# Dense tensor-core peaks from the datasheets, TFLOP/s (fp32 as TF32); first match wins.
PEAK_TFLOPS = [("H200 NVL", {"bf16": 835, "fp16": 835, "fp32": 418}), ("H200", {"bf16": 989, "fp16": 989, "fp32": 495}),
               ("H100 NVL", {"bf16": 835, "fp16": 835, "fp32": 418}), ("H100 PCIe", {"bf16": 756, "fp16": 756, "fp32": 378}),
               ("H100", {"bf16": 989, "fp16": 989, "fp32": 495}), ("A100", {"bf16": 312, "fp16": 312, "fp32": 156}),
               ("V100", {"fp16": 125, "fp32": 15.7})]


def peak_tflops(device, dtype):  # (peak TFLOP/s, which entry) for MFU, or (None, why not)
    if device.type != "cuda":
        return None, "no GPU"
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            return peaks.get(dtype), f"{key} {dtype} dense {peaks.get(dtype)} TFLOP/s"
    return None, f"{name} is not in common.PEAK_TFLOPS"


def mfu_pct(flops_per_step, seconds, peak_tflops, world_size):
    """Model FLOPs utilisation over world_size devices at their peak (None where it is unknown)."""
    if peak_tflops is None or seconds <= 0:
        return None
    return 100 * flops_per_step / seconds / (peak_tflops * 1e12 * world_size)


def synchronize(device):  # before reading a host clock: the GPU's queued work is done
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device):
    """(GiB, % of the device) at this process's peak: the CUDA allocator's reserve, or resident memory."""
    if device.type == "cuda":
        used = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return used / 2**30, 100 * used / total


def gather_floats(value, device):  # every rank's value, in rank order (a collective)
    mine = torch.tensor([float(value)], device=device)
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [round(t.item(), 2) for t in everyone]


def clock_mark(cuda):
    """Now: a CUDA event on a GPU, where the host only queues the work, else the host clock."""
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def seconds_between(start, end):  # from one clock_mark to a later one (CUDA events completed)
    return start.elapsed_time(end) / 1000 if isinstance(start, torch.cuda.Event) else end - start


class StepClock:
    """Where a step's time goes: waits for data, up to the optimizer step, the optimizer step;
    and the compute of what timed() wraps ("F" a forward, ...), so a rank's busy share is
    measured, not assumed. CUDA events on a GPU, where the host only queues the work."""

    def __init__(self, device, optimizer):
        self.cuda, self.per_step, self.busy, self.seconds_by_kind = device.type == "cuda", [], [], []
        for hook in (optimizer.register_step_pre_hook, optimizer.register_step_post_hook):
            hook(lambda *_: self.marks.append(clock_mark(self.cuda)))

    def begin(self):
        self.data, self.marks, self.spans = 0.0, [clock_mark(self.cuda)], []

    def timed_batches(self, batches):
        while True:
            start = time.perf_counter()
            batch = next(batches)
            self.data += time.perf_counter() - start
            yield batch

    def timed(self, fn, kind):
        """fn, each call an action labelled `kind` (or kind(*args, **kwargs)): "F", or "F1:0"."""

        def wrapper(*args, **kwargs):
            start = clock_mark(self.cuda)
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((start, clock_mark(self.cuda), kind(*args, **kwargs) if callable(kind) else kind))
        return wrapper

    def end(self, step_seconds):
        """Once the step's device work has finished."""
        if len(self.marks) == 1:  # the fp16 loss scaler skipped the optimizer step
            self.marks += [clock_mark(self.cuda)] * 2
            if self.cuda:
                self.marks[-1].synchronize()
        start, optimizer_start, optimizer_end = self.marks
        self.per_step.append((self.data, seconds_between(start, optimizer_start), seconds_between(optimizer_start, optimizer_end)))
        self.last_actions, by_kind = [label for _, _, label in self.spans], {}  # in the order they ran
        for begin, end, label in [*self.spans, (optimizer_start, optimizer_end, "optimizer")]:
            kind = label.split(":")[0].rstrip("0123456789")  # "F1:0", stage 1's forward of micro-batch 0, is an "F"
            total, count = by_kind.get(kind, (0.0, 0))
            by_kind[kind] = (total + seconds_between(begin, end), count + 1)
        self.busy.append(sum(total for total, _ in by_kind.values()) / step_seconds)
        self.seconds_by_kind.append(by_kind)

    def busy_pct(self, timed):  # over the steps `timed` (TrainLog.timed) selects
        busy = timed(self.busy)
        return 100 * sum(busy) / len(busy)

    def mean_seconds(self, timed):  # of one action of each kind, over the timed steps
        steps = timed(self.seconds_by_kind)
        kinds = {kind for step in steps for kind in step}
        return {kind: sum(s[kind][0] for s in steps if kind in s) / sum(s[kind][1] for s in steps if kind in s) for kind in kinds}


class NoCheckpoints(StepHook):
    """Without --checkpoint-dir: nothing to resume from, nothing saved."""

    def load(self):
        return 0


def checkpointer(args, cfg, model, optimizer, scaler=None):
    """--checkpoint-dir: options/checkpoint.py's Checkpointer (load() resumes, TrainLog saves
    through it), else NoCheckpoints. `model` has the whole model's parameter names."""
    if not args.checkpoint_dir:
        return NoCheckpoints()
    return option("checkpoint").Checkpointer(args, cfg, model, optimizer, scaler)


def option_hooks(args, env):
    """The step hooks of the flags that are on, and of the tests' TRAIN_FAULT."""
    hooks = [option("count_comm").CommCounter(args)] if args.count_comm else []
    hooks += [option("profile").Profiler(args, env)] if args.profile else []
    hooks += [option("tensorboard").Writer(args)] if args.tensorboard and IS_MAIN else []
    return hooks + ([option("faults").Faults()] if os.environ.get("TRAIN_FAULT") else [])


class TrainLog:
    """Per-step bookkeeping on every rank: agree on the loss and on stopping, time the step,
    print its line, run the step hooks (the script's and the options'), write the results."""

    def __init__(self, args, env, cfg, strategy, optimizer, start_step=0, hooks=()):
        self.args, self.env, self.cfg, self.strategy, self.start_step = args, env, cfg, strategy, start_step
        self.clock = StepClock(env.device, optimizer)
        self.hooks = [*hooks, *option_hooks(args, env)]
        self.untimed_steps = max(hook.untimed_steps for hook in [StepHook(), *self.hooks])
        self.counted_step = None  # the instrumented last step, once it runs
        self.losses, self.grad_norms, self.step_times = [], [], []
        self.flops_per_step = flops_per_token(cfg, args.seq_len) * args.global_batch_size * args.seq_len
        self.peak, self.peak_source = peak_tflops(env.device, args.dtype)
        self.stop_requested, self.peak_mem = False, peak_memory(env.device)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.watchdog = Watchdog(args.timeout)
        log(f"{strategy} | world {env.world_size} on {env.device.type} | model {args.model}: {count_params(cfg) / 1e6:.1f}M parameters | "
            f"global batch {args.global_batch_size} x {args.seq_len} tokens | {args.dtype} | MFU peak: {self.peak_source}")

    def _on_sigterm(self, signum, frame):
        # A scheduler's time limit: finish this step, let the hooks save, exit cleanly.
        self.stop_requested = True

    def steps(self):
        """The steps this run trains (from 0), from where a checkpoint left off."""
        for step in range(self.start_step, self.args.steps):
            if step == self.args.steps - 1 and any(hook.slows_last_step for hook in self.hooks):
                self.counted_step = step + 1
            for hook in self.hooks:
                hook.before_step(step + 1)
            self.clock.begin()
            self.step_start = time.perf_counter()
            yield step

    def timed_batches(self, batches):
        """The batches (None stays None), each wait for one counted as the step's data wait."""
        return None if batches is None else self.clock.timed_batches(batches)

    def end_step(self, step, loss, grad_norm, lr):
        """`loss`: this rank's share of the global mean loss (the shares sum to it). Logs the step,
        runs the hooks (a checkpoint is saved there); True when the job stops here (SIGTERM)."""
        for hook in self.hooks:
            loss = hook.before_agreement(step + 1, loss)
        # One all-reduce agrees on the loss and on the stop request.
        packed = torch.stack([loss.detach().float().reshape(()), torch.tensor(float(self.stop_requested), device=loss.device)])
        dist.all_reduce(packed)
        loss_value, stop = packed.tolist()  # waits for the step's device work
        grad_norm = float(grad_norm)
        dt = time.perf_counter() - self.step_start
        self.clock.end(dt)
        self.step_times.append(dt)
        if not math.isfinite(loss_value) and not self.env.fake:  # a fake peer's data makes any loss
            raise NonFiniteLoss(f"loss is {loss_value} at step {step + 1}; lower --lr, keep --grad-clip on, or use bf16 rather than fp16")
        self.losses.append(loss_value)
        self.grad_norms.append(grad_norm)
        self.peak_mem = peak_memory(self.env.device)
        samples, mfu, (mem_gib, mem_pct) = self.args.global_batch_size / dt, self._mfu(dt), self.peak_mem
        if (step + 1) % self.args.log_every == 0 or step + 1 == self.args.steps:
            log(f"step {step + 1:>5}/{self.args.steps} | loss {loss_value:.4f} | grad norm {grad_norm:.3f} | lr {lr:.2e} | "
                f"{dt * 1000:7.1f} ms | {samples:7.2f} samples/s | {samples * self.args.seq_len:9.0f} tok/s | "
                f"MFU {'n/a' if mfu is None else f'{mfu:.1f}%'} | mem {mem_gib:.2f} GiB ({mem_pct:.0f}%)")
        if stop > 0:
            log(f"SIGTERM: stopping after step {step + 1}")
        self.watchdog.progress(f"step {step + 1}")
        metrics = {"loss": loss_value, "grad_norm": grad_norm, "lr": lr, "step_seconds": dt, "tokens_per_sec": samples * self.args.seq_len,
                   "mfu_pct": mfu, "peak_mem_gib": mem_gib}
        for hook in self.hooks:
            hook.after_step(step + 1, metrics, stop > 0)
        return stop > 0

    def _mfu(self, seconds):
        return mfu_pct(self.flops_per_step, seconds, self.peak, self.env.world_size)

    def timed(self, per_step):
        """What throughput uses of a per-step list: not --timing-warmup-steps, nor what a hook
        slows (the profiler's, the counted last step), unless nothing else is left."""
        start = max(0, min(self.args.timing_warmup_steps + self.untimed_steps, len(per_step) - 1))
        counted = self.counted_step is not None and len(per_step) - start > 1 and self.start_step + len(per_step) == self.counted_step
        return per_step[start:len(per_step) - 1 if counted else len(per_step)]

    def throughput(self):  # (samples/s, seconds per step) over the timed steps
        timed = self.timed(self.step_times)
        seconds = sum(timed) / len(timed) if timed else float("nan")
        return self.args.global_batch_size / seconds, seconds

    def step_parts(self):
        """StepClock's parts of the mean timed step, averaged over the ranks (a collective)."""
        steps = self.timed(self.clock.per_step)
        mean = torch.tensor([sum(part) / len(steps) for part in zip(*steps)] + [1.0], dtype=torch.float64, device=self.env.device)
        dist.all_reduce(mean)  # the last entry counts the ranks that answered
        return dict(zip(("data", "to_optimizer", "optimizer"), (mean[:-1] / mean[-1]).tolist()))

    def finish(self, **extra):
        """Summary line and, with --results, the JSON line from rank 0 (a collective)."""
        self.watchdog.stop()
        hooked = {k: v for hook in self.hooks for k, v in hook.results().items()}
        mem = torch.tensor(self.peak_mem, device=self.env.device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        mem_gib, mem_pct = mem.tolist()
        per_rank = None if self.env.fake else gather_floats(self.peak_mem[0], self.env.device)  # a fake world's exist nowhere
        parts = self.step_parts()
        samples_per_sec, seconds = self.throughput()
        mfu = self._mfu(seconds)
        record = {
            "strategy": self.strategy, "world_size": self.env.world_size, "device": self.env.device.type,
            "gpu_name": torch.cuda.get_device_name(self.env.device) if self.env.device.type == "cuda" else None,
            "model": self.args.model, "params": count_params(self.cfg), "global_batch_size": self.args.global_batch_size,
            "seq_len": self.args.seq_len, "steps": self.args.steps, "start_step": self.start_step,
            "losses": self.losses, "grad_norms": self.grad_norms,
            "samples_per_sec": samples_per_sec, "tokens_per_sec": samples_per_sec * self.args.seq_len, "mfu": mfu,
            "peak_mem_gib": mem_gib, "mem_pct": mem_pct, "peak_mem_gib_per_rank": per_rank,
            "comm_pct": None,  # the share of a step communication took, where a strategy measures it
            "comm_per_step": None,  # with --count-comm: the last step's collectives
            "simulated_rank": self.env.rank if self.env.fake else None,  # world_size is then the simulated world's
            "step_seconds": seconds, "step_parts_seconds": parts,  # see StepClock
            # What checkpoints cost: saves (left out of step_seconds), steps waiting for their copy (in it).
            "checkpoints_saved": 0, "checkpoint_stall_seconds": 0.0,
            "torch_version": torch.__version__, "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            **hooked, **extra, "config": vars(self.args),
        }
        log(f"done | {samples_per_sec:.2f} samples/s | {record['tokens_per_sec']:.0f} tok/s | "
            f"MFU {'n/a' if mfu is None else f'{mfu:.1f}%'} | peak mem {mem_gib:.2f} GiB ({mem_pct:.0f}%)"
            + "".join(f" | {k} {v:.3g}" for k, v in extra.items() if isinstance(v, float)))
        if IS_MAIN and self.args.results:
            try:
                with open(self.args.results, "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:
                raise OutputError(f"--results {self.args.results}: the results line cannot be written ({e.strerror or e})") from None
        return record
