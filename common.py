"""What every strategy script shares: the model, the data, the command line, the
process group, metrics, the results record and checkpoints; at the end, in its own
section, the pipeline helpers that pipeline_train.py and hybrid_train.py both use.

Nothing here is specific to one strategy: the parallelism itself lives in each
*_train.py, which reads top to bottom as the story of one strategy.
"""

import argparse
import importlib.util
import inspect
import json
import logging
import math
import os
import random
import re
import resource
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
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
    # GPT-3 6.7B shape: fp32 Adam needs ~107 GB before activations. On one H200, DDP holds
    # it at batch 8 (131 GiB) but not 16; FSDP with CPU offload trains it at 16 in 74 GiB.
    "6.7b": ModelConfig(n_layers=32, n_heads=32, d_model=4096, vocab_size=32000, max_seq_len=1024, lr=1.2e-4),
}
# The 2.5b shape with a position table of 128k tokens, for long-context runs (context
# parallelism): --seq-len may then go 128x past 2.5b's 1024.
PRESETS["2.5b-long"] = replace(PRESETS["2.5b"], max_seq_len=131072)


def causal_attention(q, k, v):
    """Each token attends to itself and the tokens before it; q, k, v are (B, heads, T, head_dim)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.head_dim = d // cfg.n_heads
        # q, k and v in one matrix product: under autocast one cast of the input to bf16
        # and one input gradient, not three (and their sum). Output features are grouped by
        # head, [q k v] of head 0, then of head 1, ..., so tensor parallelism's split of
        # them hands each rank whole heads.
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.attention = causal_attention  # context parallelism swaps in its ring attention

    def forward(self, x):
        B, T, _ = x.shape
        # -1 heads, not n_heads: under tensor parallelism a rank holds n_heads / tp of them.
        # Split before the transpose: backward then joins the three gradients straight into
        # qkv's layout in one copy (unbind, or a transpose first, costs a second copy).
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


class Block(nn.Module):
    """Pre-LayerNorm Transformer block."""

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
    """Decoder-only Transformer, or any consecutive slice of one.

    Blocks sit in a ModuleDict keyed by their global index, so a parameter has the same
    name on every stage and in every checkpoint; embeddings and head are optional, so a
    pipeline stage builds only what it runs. The head is not tied to the embedding: tying
    would couple the first and last pipeline stages.
    """

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
        """positions: each token's place in the whole sequence, where x holds only part of
        it (context parallelism); by default 0 .. T-1."""
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
        """GPT-2 init, each part from its own generator seeded by (seed, part): a stage
        that builds only blocks 8-15 gets exactly the weights the whole model has there."""
        parts = [("embed", [self.tok_emb, self.pos_emb])] if self.tok_emb is not None else []
        parts += [(f"block{i}", [b]) for i, b in self.blocks.items()]
        parts += [("head", [self.norm, self.head])] if self.head is not None else []
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, modules in parts:
            gen = torch.Generator(self._device()).manual_seed(seed * 1_000_003 + _part_index(name, self.cfg))
            for module in modules:
                for pname, p in module.named_parameters():
                    if isinstance(module, nn.LayerNorm) or "norm" in pname:
                        nn.init.ones_(p) if pname.endswith("weight") else nn.init.zeros_(p)
                    else:
                        std = residual_std if pname.endswith(("o.weight", "fc_out.weight")) else 0.02
                        nn.init.normal_(p, 0.0, std, generator=gen)

    def _device(self):
        return next(self.parameters()).device


def _part_index(name, cfg):
    if name == "embed":
        return 0
    if name == "head":
        return cfg.n_layers + 1
    return int(name.removeprefix("block")) + 1


def build_model(cfg, device, args, layers=None, embed=True, head=True, fsdp=False):
    """Build (a slice of) the model straight on `device` (a 2.5B model never materialises
    on the CPU first), give it its deterministic weights from --seed, and apply --float8
    (fsdp: the caller will shard it with fully_shard), --activation-checkpointing and
    --compile."""
    with torch.device(device):
        model = GPT(cfg, layers, embed, head)
    model.init_weights(args.seed)
    if args.float8:
        convert_to_float8(model, args, device, fsdp)
    model.activation_checkpointing = args.activation_checkpointing
    if args.compile:
        # Each block in place: names stay as they were (no `_orig_mod.`), and every
        # strategy's wrapping (DDP, FSDP, pipeline stages, DTensor) sees the same modules.
        for block in model.blocks.values():
            block.compile()
    return model


def convert_to_float8(model, args, device, fsdp):
    """--float8: every block's linear runs its matmuls in float8 through torchao, with a
    scale per tensor (tensorwise) or per row (rowwise) computed from each input's amax;
    weights, gradients and optimizer state stay in high precision, so checkpoints are
    those of a bf16 run. The head stays in bf16: the loss reads its logits."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        check(capability >= (8, 9), f"--float8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper); "
                                    f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(args.float8)
    if fsdp and args.float8 == "tensorwise":
        # FSDP then gathers each weight already cast to float8: half the bytes of bf16.
        config = replace(config, enable_fsdp_float8_all_gather=True)
    # float8 kernels need both dimensions divisible by 16.
    kept = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and
            (name == "head" or m.in_features % 16 or m.out_features % 16)]
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, name: name not in kept)
    model.float8_fsdp_all_gather = config.enable_fsdp_float8_all_gather
    n = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    log_once(f"float8 {args.float8}: {n} linears converted; kept in {args.dtype}: {', '.join(kept) or 'none'}"
             f"{'; weights all-gathered in float8' if model.float8_fsdp_all_gather else ''}")
    if device.type == "cuda" and not args.compile:
        log_once("note: --float8 without --compile is slower than bf16 (its casts and scales run as separate kernels): add --compile")


def precompute_float8_scales(model):
    """After the optimizer step, with FSDP's float8 all-gather: every weight's scale for
    the next step, in one all-reduce of their amaxes instead of one per weight."""
    if any(getattr(m, "float8_fsdp_all_gather", False) for m in model.modules()):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)


def count_params(cfg):
    d, L, V = cfg.d_model, cfg.n_layers, cfg.vocab_size
    block = 12 * d * d + 4 * d  # qkv, o, MLP in and out; two LayerNorms' weight and bias
    return V * d + cfg.max_seq_len * d + L * block + 2 * d + d * V


def flops_per_token(cfg, seq_len):
    """Training FLOPs per token, 6N + 12·L·d·T (PaLM appendix B): N counts the matmul
    weights of blocks and head, not the embeddings (lookups, not matmuls); the second
    term is attention's QK^T and AV."""
    n_matmul = cfg.n_layers * 12 * cfg.d_model**2 + cfg.d_model * cfg.vocab_size
    return 6 * n_matmul + 12 * cfg.n_layers * cfg.d_model * seq_len


def loss_fn(logits, targets):
    """Mean next-token cross entropy, in fp32 whatever the logits' dtype: log_softmax reads
    bf16 logits and writes fp32 in one kernel, where .float() first would copy them."""
    log_probs = F.log_softmax(logits.flatten(0, 1), dim=-1, dtype=torch.float32)
    return F.nll_loss(log_probs, targets.flatten())


def make_loss_fn(args):
    """loss_fn as the step calls it: compiled too under --compile. Eager, forward and
    backward each pass over a (tokens x vocabulary) fp32 tensor several times; compiled,
    those passes are fused into a few kernels."""
    return torch.compile(loss_fn) if args.compile else loss_fn


# ----------------------------------------------------------------------------
# Data: a deterministic synthetic stream, or a file of token ids
# ----------------------------------------------------------------------------


class MarkovTokens(Dataset):
    """Sample i depends only on (seed, i), never on rank or world size, so every strategy
    trains on the same global batches. Tokens follow a fixed sparse Markov chain: each
    token has 4 equally likely successors, so a model can learn it and the loss falls
    from ln(vocab) towards ln(4) = 1.386."""

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


class TokenFile(Dataset):
    """A flat binary file of uint16 token ids (nanoGPT's train.bin), checked whole by
    check_token_file before training. Sample i is the window at an offset drawn from (seed, i)."""

    def __init__(self, path, seq_len, seed):
        self.path, self.seq_len, self.seed = path, seq_len, seed
        self.n_tokens = os.path.getsize(path) // 2
        self.fd = None

    def __getitem__(self, i):
        if self.fd is None:  # opened lazily, once per DataLoader worker
            self.fd = os.open(self.path, os.O_RDONLY)
        start = random.Random(f"{self.seed}:{i}").randrange(self.n_tokens - self.seq_len - 1)
        raw = os.pread(self.fd, 2 * (self.seq_len + 1), 2 * start)
        t = torch.frombuffer(bytearray(raw), dtype=torch.uint16).long()
        return t[:-1], t[1:]


def check_token_file(path, vocab_size, seq_len):
    """Refuse a --data file that could fail mid-run: missing, not a file, unreadable, an odd
    byte count, too short for one sample, or holding ids beyond the vocabulary."""
    check(os.path.exists(path), f"--data {path} does not exist")
    check(os.path.isfile(path), f"--data {path} is not a file (give a flat file of uint16 token ids)")
    check(os.access(path, os.R_OK), f"--data {path} is not readable")
    size = os.path.getsize(path)
    check(size % 2 == 0, f"--data {path} holds {size} bytes, an odd count: not a file of uint16 token ids")
    check(size // 2 >= seq_len + 2, f"--data {path} holds {size // 2} tokens; one sample needs --seq-len + 2 = {seq_len + 2}")
    import numpy as np  # a dependency anyway (torch's object collectives); reads the file without copying it

    largest = int(np.memmap(path, dtype=np.uint16, mode="r").max())
    check(largest < vocab_size, f"--data {path} holds token id {largest}, beyond the vocabulary of {vocab_size}: "
          f"set --vocab-size {largest + 1} or more")


class StepSampler(Sampler):
    """Step s's global batch is samples [s·G, (s+1)·G); data-parallel rank r of D takes the
    r-th contiguous G/D of them. Starting at `start_step` is how a resumed run picks up
    exactly where the checkpoint left off."""

    def __init__(self, global_batch_size, dp_rank, dp_size, start_step):
        self.global_batch_size, self.dp_rank, self.dp_size, self.start_step = global_batch_size, dp_rank, dp_size, start_step

    def __iter__(self):
        local = self.global_batch_size // self.dp_size
        step = self.start_step
        while True:
            first = step * self.global_batch_size + self.dp_rank * local
            yield from range(first, first + local)
            step += 1


def _leave_process_group(worker_id):
    # torchrun stops a job by signalling each rank's process group. A DataLoader worker
    # killed mid-step would make its trainer raise before it could checkpoint, so workers
    # leave that group: the trainer stops them when it exits, and if the trainer dies they
    # see their parent gone within seconds (DataLoader's own watchdog) and exit.
    os.setpgid(0, 0)
    # A worker handing a batch over (multiprocessing's resource sharer, a thread) as its
    # trainer exits would print the broken handshake's traceback under the trainer's one
    # line; errors of the worker's own work reach the trainer by another way.
    excepthook = sys.excepthook
    sys.excepthook = lambda kind, e, tb: None if issubclass(kind, (ConnectionError, EOFError)) else excepthook(kind, e, tb)


def make_batches(args, cfg, device, batch_size, dp_rank=0, dp_size=1, start_step=0):
    """An endless iterator of (inputs, targets) on `device`, `batch_size` samples each."""
    if args.data:
        dataset = TokenFile(args.data, args.seq_len, args.seed)
    else:
        dataset = MarkovTokens(cfg.vocab_size, args.seq_len, args.seed)
    # No persistent_workers (the article's advice): it only spares re-creating workers at
    # each epoch, and this loader streams without epochs, its workers alive all run long.
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=StepSampler(args.global_batch_size, dp_rank, dp_size, start_step),
        num_workers=args.num_workers,
        pin_memory=device.type == "cuda",  # page-locked host memory: faster, async copies
        worker_init_fn=_leave_process_group,
    )
    return ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def number(cast, low, high=math.inf, low_open=False, accepted=""):
    """An argparse type: a finite number of `cast` within [low, high] (above low if
    low_open). Its refusal names what would be accepted."""

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
    """--help and usage errors from rank 0 only, instead of once per process; an error
    is one line, like every other refusal."""

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
    g.add_argument("--float8", choices=["tensorwise", "rowwise"],
                   help="run the blocks' matmuls in float8 through torchao, scaled per tensor or per row (Hopper or newer; pays with "
                        "--compile on large matmuls, see README); the head stays in --dtype")
    g = p.add_argument_group("system")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA with NCCL where there is a GPU, else CPU with gloo")
    g.add_argument("--timeout", type=number(float, 1, 7 * 86400, accepted="a number of seconds from 1 to 604800 (a week)"), default=600,
                   help="seconds a collective waits for a peer, and a step may take, before the job fails (default: 600)")
    g.add_argument("--simulate", type=number(int, 2, 4096, accepted="a number of ranks from 2 to 4096"), metavar="N",
                   help="run as one rank of an N-rank job on this one device (a fake process group): that rank's compute and memory are "
                        "real, its communication is counted, not sent; run_all.sh --simulate predicts from it (see README)")
    g.add_argument("--simulate-rank", type=non_negative, default=0, metavar="R", help="with --simulate: the rank to be (default: 0)")
    g = p.add_argument_group("output")
    g.add_argument("--log-every", type=positive, default=1, help="print a step line every N steps (default: 1)")
    g.add_argument("--timing-warmup-steps", type=non_negative, default=3, help="first steps left out of throughput figures (default: 3)")
    g.add_argument("--profile", metavar="DIR", help="trace a few steps with torch.profiler into DIR and print the op table")
    g.add_argument("--tensorboard", metavar="DIR", help="log loss, lr, step time, tokens/s, MFU and memory every step into DIR for TensorBoard (rank 0)")
    g.add_argument("--results", metavar="FILE", help="append one JSON line with this run's figures to FILE")
    g.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints here (always after the last step), and resume from the newest one that loads")
    g.add_argument("--checkpoint-every", type=non_negative, default=0, help="with --checkpoint-dir, also save every N steps (default: 0: only after the last step and on SIGTERM)")
    return p


def parse_args(parser):
    """Parse the command line and check every option against the others and every file
    and folder it names, before any process group or model exists: what cannot run is
    refused in one line (ConfigError). Returns (args, the model's config); fills in
    args.seq_len and args.lr from the preset where they were not given."""
    args = parser.parse_args()
    cfg = PRESETS[args.model]
    if args.vocab_size is not None:
        cfg = replace(cfg, vocab_size=args.vocab_size)
    args.seq_len = cfg.max_seq_len if args.seq_len is None else args.seq_len
    args.lr = cfg.lr if args.lr is None else args.lr
    check(args.seq_len <= cfg.max_seq_len, f"--seq-len {args.seq_len} exceeds the {args.model} preset's context of {cfg.max_seq_len}")
    check(args.lr_warmup_steps <= args.steps, f"--lr-warmup-steps {args.lr_warmup_steps} must be at most --steps {args.steps}")
    check(not args.checkpoint_every or args.checkpoint_dir, "--checkpoint-every needs --checkpoint-dir DIR to save into")
    check(not args.profile or args.steps >= args.timing_warmup_steps + 4,
          f"--profile traces 3 steps after --timing-warmup-steps {args.timing_warmup_steps} and one more: it needs --steps of at least {args.timing_warmup_steps + 4}")
    if args.simulate:
        check(args.simulate_rank < args.simulate, f"--simulate-rank {args.simulate_rank} must be below --simulate {args.simulate}")
        check(int(os.environ.get("WORLD_SIZE", "1")) == 1, "--simulate plays every rank's part in one process: launch it with python, not torchrun on several")
        check(not args.checkpoint_dir, "--simulate cannot checkpoint: the other ranks' parts exist nowhere")
    check(args.simulate or not args.simulate_rank, "--simulate-rank needs --simulate N")
    check(not args.float8 or importlib.util.find_spec("torchao") is not None,
          "--float8 needs torchao: pip install torchao (tested with 0.18.0)")
    if args.data:
        check_token_file(args.data, cfg.vocab_size, args.seq_len)
    if args.tensorboard:
        check(importlib.util.find_spec("tensorboard") is not None, "--tensorboard needs the tensorboard package: pip install tensorboard")
    for option, folder in (("--checkpoint-dir", args.checkpoint_dir), ("--profile", args.profile), ("--tensorboard", args.tensorboard)):
        if folder:
            _check_folder(option, folder)
    if args.results and IS_MAIN:  # only rank 0 writes it
        _check_results_file(args.results)
    return args, cfg


def _check_folder(option, path):
    """A folder every rank writes into: made if missing, refused if it cannot be."""
    check(not os.path.exists(path) or os.path.isdir(path), f"{option} {path} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option} {path} cannot be made: {e.strerror}") from None
    check(os.access(path, os.W_OK | os.X_OK), f"{option} {path} is not writable")


def _check_results_file(path):
    folder = os.path.dirname(os.path.abspath(path))
    check(os.path.isdir(folder), f"--results {path}: the folder {folder} does not exist")
    check(not os.path.isdir(path), f"--results {path} is a folder: give a file to append the results line to")
    check(os.access(path if os.path.exists(path) else folder, os.W_OK), f"--results {path} is not writable")


# ----------------------------------------------------------------------------
# Errors: one clear line on rank 0, not a traceback from every rank
# ----------------------------------------------------------------------------


class ConfigError(Exception):
    """A configuration the job cannot run. Every rank reaches the same verdict, so every
    rank raises it and exits; only rank 0 says why."""


class NonFiniteLoss(Exception):
    pass


def check(ok, message):
    if not ok:
        raise ConfigError(message)


def _lost_peer(e):
    """A collective or transfer that failed because a peer is gone or silent: raised from
    inside torch.distributed as a timeout or a broken connection (gloo raises these as
    plain RuntimeErrors). Anything else is a bug and keeps its traceback."""
    tb = e.__traceback__
    while tb.tb_next:
        tb = tb.tb_next
    in_distributed = f"{os.sep}torch{os.sep}distributed{os.sep}" in tb.tb_frame.f_code.co_filename
    return isinstance(e, dist.DistError) or (in_distributed and re.search(r"[Tt]imed out|[Cc]onnection|by peer", str(e)) is not None)


_exiting = threading.Event()  # set once run() handles the end, so the Watchdog stays quiet


def run(main):
    """Run a script's main() and turn the failures a user can act on into one line.
    Every way out ends this process: DataLoader workers stop with it (or, if it is
    killed, see it gone), and the Watchdog ends a process whose steps stall."""
    code, finished = 0, False
    try:
        main()
        finished = True
    except (ConfigError, NonFiniteLoss) as e:  # every rank alike: rank 0 speaks for all
        _exiting.set()
        code = 2 if isinstance(e, ConfigError) else 3
        if IS_MAIN:
            print(f"error: {e}", file=sys.stderr, flush=True)
    except torch.OutOfMemoryError as e:
        _exiting.set()
        code = 1
        print(f"error: rank {RANK} ran out of memory ({str(e).splitlines()[0][:120]}): try --activation-checkpointing, "
              "a smaller --global-batch-size or more --grad-accum, or a strategy that shards the model", file=sys.stderr, flush=True)
    except BrokenPipeError:  # `... | head`: the reader left, so nobody is listening
        _exiting.set()
        code = 1
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own exit flush would fail again
    except KeyboardInterrupt:
        _exiting.set()
        code = 130
        if IS_MAIN:
            print("interrupted", file=sys.stderr, flush=True)
    except (dist.DistError, RuntimeError) as e:
        _exiting.set()
        if not _lost_peer(e):
            raise
        code = 1
        reason = re.sub(r"^\[[^\]]*\] ", "", str(e).strip().splitlines()[0])  # drop gloo's source location
        print(f"error: rank {RANK} lost a peer ({reason}): another rank died or stalled past --timeout; its log says why",
              file=sys.stderr, flush=True)
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
    """Ends this process when training makes no progress for --timeout seconds. A
    collective times out only while a live peer waits in it; this also ends a job whose
    ranks are all stuck at once (a dead filesystem, a deadlock, a hung device)."""

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
# Processes and devices
# ----------------------------------------------------------------------------


@dataclass
class Env:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(args, cpu_collectives=False):
    """Bind this process to its device and join the process group (torchrun's env://).
    Without torchrun it runs as a world of one. Also settles args.dtype. With
    cpu_collectives, a GPU job also gets gloo for collectives on CPU tensors."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        check(torch.cuda.is_available(), "--device cuda, but torch sees no GPU")
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        check(local_ranks <= torch.cuda.device_count(), f"{local_ranks} processes on this node but {torch.cuda.device_count()} GPU(s): NCCL needs one GPU per rank (lower --nproc_per_node, or --device cpu)")
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
        # Every collective and transfer returns at once, having moved nothing (a receive
        # fills nothing); everything else, this rank's share of the work, is real.
        from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

        dist.init_process_group("fake", store=FakeStore(), rank=args.simulate_rank, world_size=args.simulate)
        world_size = args.simulate
        log(f"simulated: rank {args.simulate_rank} of {args.simulate} on one {device.type}; its compute and memory are real, its "
            "communication counted, not sent. Losses from data no peer sent mean nothing, so the NaN stop is off.")
    elif "RANK" in os.environ:
        # device_id binds NCCL's communicator to this GPU at once (no guessing, no hang).
        dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Env(dist.get_rank(), world_size, local_rank, device)


def simulated_allreduce_hook(dtype):
    """DDP's communication hook under --simulate: a fake all-reduce returns no future for
    DDP to wait on, so the bucket is all-reduced at once (counted, in the dtype the
    chosen --comm-hook would send) and handed back done."""

    def hook(group, bucket):  # registered with DDP's process group as its state
        dist.all_reduce(bucket.buffer().to(dtype), group=group)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    return hook


def make_mesh(env, **dims):
    """The one place a script's DeviceMesh is built: make_mesh(env, pp=2, dp=4). The last
    dimension holds consecutive ranks, which torchrun places on the same node."""
    shape = tuple(dims.values())
    check(math.prod(shape) == env.world_size, f"mesh {' x '.join(f'{k}={v}' for k, v in dims.items())} needs {math.prod(shape)} ranks, but the world has {env.world_size}")
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(env.device.type, shape, mesh_dim_names=tuple(dims))


def autocast(args, device):
    if args.dtype == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float16)


def torch_version():
    return tuple(int(part) for part in torch.__version__.split(".")[:2])


def refuse_fp16(args, why):
    check(args.dtype != "fp16", f"--dtype fp16 is not supported here: {why}; use bf16 (or fp32 on GPUs without bf16)")


# ----------------------------------------------------------------------------
# Optimizer, learning rate, gradient clipping
# ----------------------------------------------------------------------------


def make_optimizer(params, args):
    """AdamW with decay on matrices only (not norms), fused into one kernel (CPU and CUDA
    alike, so the tests run the GPU's update and its clipping, see clip_grad_norm_)."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=True)


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


def _is_dtensor(t):
    # Importing DTensor costs a second per process; one that never made a DTensor need not.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def clip_grad_norm_(optimizer, max_norm, group=None):
    """Clip by the norm over the WHOLE model and return that norm. DTensor gradients (FSDP,
    TP) are reduced over their mesh; `group` sums the squares over ranks that hold
    different parts (pipeline stages), so every rank clips by the same global norm.
    The clip happens inside the next optimizer.step(): fused AdamW divides each gradient
    by `optimizer.grad_scale` (the hook GradScaler uses; it multiplies its own scale in)
    while it updates the weights, so no separate pass rescales every gradient (at 2.5b,
    10 GB read and written again: by bandwidth about 1% of an H100 step, not yet timed)."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params]).float()
    if _is_dtensor(total):
        total = total.full_tensor()
    if group is not None:
        total_sq = total**2
        dist.all_reduce(total_sq, group=group)
        total = total_sq.sqrt()
    if max_norm > 0:
        # The same factor as clip_grads_with_norm_, max_norm / (total + 1e-6) when below 1, inverted.
        optimizer.grad_scale = torch.clamp((total + 1e-6) / max_norm, min=1.0)
    return total


# ----------------------------------------------------------------------------
# Metrics, the step log and the results record
# ----------------------------------------------------------------------------

# Dense (no sparsity) tensor-core peaks per GPU from the vendors' datasheets, in TFLOP/s.
# fp32 runs as TF32 where the GPU has it (init_distributed asks for that). First match wins.
PEAK_TFLOPS = [
    ("H200 NVL", {"bf16": 835, "fp16": 835, "fp32": 418}),
    ("H200", {"bf16": 989, "fp16": 989, "fp32": 495}),
    ("H100 NVL", {"bf16": 835, "fp16": 835, "fp32": 418}),
    ("H100 PCIe", {"bf16": 756, "fp16": 756, "fp32": 378}),
    ("H100", {"bf16": 989, "fp16": 989, "fp32": 495}),
    ("A100", {"bf16": 312, "fp16": 312, "fp32": 156}),
    ("V100", {"fp16": 125, "fp32": 15.7}),
]


def peak_tflops(device, dtype):
    """(peak TFLOP/s, which GPU entry) for MFU, or (None, why not)."""
    if device.type != "cuda":
        return None, "no GPU"
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS:
        if key in name:
            return peaks.get(dtype), f"{key} {dtype} dense {peaks.get(dtype)} TFLOP/s"
    return None, f"{name} is not in common.PEAK_TFLOPS"


def mfu_pct(flops_per_step, seconds, peak_tflops, world_size):
    """Model FLOPs utilisation: the model's FLOPs per step over what world_size devices
    at their peak could do in that time (None where the peak is unknown)."""
    if peak_tflops is None or seconds <= 0:
        return None
    return 100 * flops_per_step / seconds / (peak_tflops * 1e12 * world_size)


def synchronize(device):
    """Wait for the work queued on a GPU, before reading a host clock; nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device):
    """(GiB, % of the device) this process held at its peak: the CUDA caching allocator's
    reserve on a GPU, resident memory against physical RAM on the CPU."""
    if device.type == "cuda":
        used = torch.cuda.max_memory_reserved(device)
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        used = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return used / 2**30, 100 * used / total


def gather_floats(value, device):
    """Every rank's value of a float, in rank order (a collective)."""
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


def seconds_between(start, end):
    """Seconds from one clock_mark to a later one (CUDA events must have completed)."""
    return start.elapsed_time(end) / 1000 if isinstance(start, torch.cuda.Event) else end - start


class StepClock:
    """Where a step's time goes on this rank: its waits for data (host time in next() of
    the batches), its start to the optimizer step's (forward, backward, clipping and what
    they wait on), and the optimizer step. sweep_report.py makes the report's parts of them."""

    def __init__(self, device, optimizer):
        self.cuda, self.per_step = device.type == "cuda", []
        for hook in (optimizer.register_step_pre_hook, optimizer.register_step_post_hook):
            hook(lambda *_: self.marks.append(clock_mark(self.cuda)))

    def begin(self):
        self.data, self.marks = 0.0, [clock_mark(self.cuda)]

    def timed_batches(self, batches):
        while True:
            start = time.perf_counter()
            batch = next(batches)
            self.data += time.perf_counter() - start
            yield batch

    def end(self):
        """Once the step's device work has finished: appends (data, to optimizer, optimizer) seconds."""
        if len(self.marks) == 1:  # the fp16 loss scaler skipped the optimizer step
            self.marks += [clock_mark(self.cuda)] * 2
            if self.cuda:
                self.marks[-1].synchronize()
        start, optimizer_start, optimizer_end = self.marks
        self.per_step.append((self.data, seconds_between(start, optimizer_start), seconds_between(optimizer_start, optimizer_end)))


class TrainLog:
    """Per-step bookkeeping, the same on every rank: agree on the global loss and on
    whether to stop, time the step and its parts, print the step line (and with
    --tensorboard log it), write the results record. Scripts pass their optimizer (its
    step is timed) and read their batches through timed_batches()."""

    def __init__(self, args, env, cfg, strategy, ckpt, optimizer):
        self.args, self.env, self.cfg, self.strategy, self.ckpt = args, env, cfg, strategy, ckpt
        self.clock = StepClock(env.device, optimizer)
        self.tensorboard = None
        if args.tensorboard and IS_MAIN:  # imported only when asked for: it takes a second
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(args.tensorboard)
        self.start_step = ckpt.start_step
        self.losses, self.grad_norms, self.step_times = [], [], []
        self.flops_per_step = flops_per_token(cfg, args.seq_len) * args.global_batch_size * args.seq_len
        self.peak, self.peak_source = peak_tflops(env.device, args.dtype)
        self.stop_requested = False
        self.peak_mem = peak_memory(env.device)
        signal.signal(signal.SIGTERM, self._on_sigterm)
        self.watchdog = Watchdog(args.timeout)
        self.comm, self.counted_step = CommCounter(), None
        log(f"{strategy} | world {env.world_size} on {env.device.type} | model {args.model}: {count_params(cfg) / 1e6:.1f}M parameters | "
            f"global batch {args.global_batch_size} x {args.seq_len} tokens | {args.dtype} | MFU peak: {self.peak_source}")
        self.last, self.saved_before = time.perf_counter(), ckpt.save_seconds

    def _on_sigterm(self, signum, frame):
        # A scheduler's time limit: finish this step, checkpoint, exit cleanly.
        self.stop_requested = True

    def steps(self):
        """The steps this run trains, from where a checkpoint left off. The last one's
        communication is counted (its time is left out of throughput where other
        steps were timed: the counter slows each op down)."""
        for step in range(self.start_step, self.args.steps):
            last = step == self.args.steps - 1
            if last:
                self.counted_step = step + 1
            # Until end_step, so that its own bookkeeping all-reduce is not counted.
            self.comm.start(count=last, fill_receives=bool(self.args.simulate) and step == self.start_step)
            self.clock.begin()
            yield step

    def timed_batches(self, batches):
        """The batches (None stays None), each wait for one counted as the step's data wait."""
        return None if batches is None else self.clock.timed_batches(batches)

    def end_step(self, step, loss, grad_norm, lr):
        """`loss` is this rank's share of the global-batch mean loss (the shares of all ranks
        sum to it). Returns True when a SIGTERM asks the job to stop after this step."""
        self.comm.stop()
        fault_point("step", step + 1)
        if fault_point("loss", step + 1):
            loss = loss * float("nan")
        # One all-reduce agrees on the loss and on the stop request.
        packed = torch.stack([loss.detach().float().reshape(()), torch.tensor(float(self.stop_requested), device=loss.device)])
        dist.all_reduce(packed)
        loss_value, stop = packed.tolist()  # waits for the step's device work
        grad_norm = float(grad_norm)
        self.clock.end()
        now = time.perf_counter()
        # A checkpoint saved after the previous step is not part of this one.
        self.step_times.append(now - self.last - (self.ckpt.save_seconds - self.saved_before))
        self.last, self.saved_before = now, self.ckpt.save_seconds
        if not math.isfinite(loss_value) and not self.args.simulate:
            raise NonFiniteLoss(f"loss is {loss_value} at step {step + 1}; lower --lr, keep --grad-clip on, or use bf16 rather than fp16")
        self.losses.append(loss_value)
        self.grad_norms.append(grad_norm)
        if step + 1 != self.counted_step or len(self.losses) == 1:
            # Not the counted step's: under the counter compiled blocks run eager, with eager's memory.
            self.peak_mem = peak_memory(self.env.device)
        dt = self.step_times[-1]
        samples = self.args.global_batch_size / dt
        mfu = self._mfu(dt)
        mem_gib, mem_pct = self.peak_mem
        if self.tensorboard is not None:  # every step, whatever --log-every says; MFU only where a peak is known
            for tag, value in (("loss", loss_value), ("grad_norm", grad_norm), ("lr", lr), ("step_seconds", dt),
                               ("tokens_per_sec", samples * self.args.seq_len), ("mfu_pct", mfu), ("peak_mem_gib", mem_gib)):
                if value is not None:
                    self.tensorboard.add_scalar(tag, value, step + 1)
        if (step + 1) % self.args.log_every == 0 or step + 1 == self.args.steps:
            log(f"step {step + 1:>5}/{self.args.steps} | loss {loss_value:.4f} | grad norm {grad_norm:.3f} | lr {lr:.2e} | "
                f"{dt * 1000:7.1f} ms | {samples:7.2f} samples/s | {samples * self.args.seq_len:9.0f} tok/s | "
                f"MFU {'n/a' if mfu is None else f'{mfu:.1f}%'} | mem {mem_gib:.2f} GiB ({mem_pct:.0f}%)")
        if stop > 0:
            log(f"SIGTERM: stopping after step {step + 1}")
        self.watchdog.progress(f"step {step + 1}")
        return stop > 0

    def _mfu(self, seconds):
        return mfu_pct(self.flops_per_step, seconds, self.peak, self.env.world_size)

    def timed(self, per_step):
        """The entries of a per-step list that throughput figures use: not the first
        --timing-warmup-steps, nor --profile's (its warm-up, 3 traced, and the one its trace's
        export lands in), nor the counted last step, unless nothing else is left."""
        start = max(0, min(self.args.timing_warmup_steps + (5 if self.args.profile else 0), len(per_step) - 1))
        counted = self.counted_step is not None and len(per_step) - start > 1 and self.start_step + len(per_step) == self.counted_step
        return per_step[start:len(per_step) - 1 if counted else len(per_step)]

    def throughput(self):
        """(samples/s, seconds per step) over the timed steps."""
        timed = self.timed(self.step_times)
        seconds = sum(timed) / len(timed) if timed else float("nan")
        return self.args.global_batch_size / seconds, seconds

    def step_parts(self):
        """StepClock's parts of the mean timed step, averaged over the ranks (a collective,
        except for a simulated rank: its peers exist nowhere)."""
        steps = self.timed(self.clock.per_step)
        mean = torch.tensor([sum(part) / len(steps) for part in zip(*steps)], dtype=torch.float64, device=self.env.device)
        if not self.args.simulate:
            dist.all_reduce(mean)
            mean /= self.env.world_size
        return dict(zip(("data", "to_optimizer", "optimizer"), mean.tolist()))

    def finish(self, **extra):
        """Summary line and, with --results, one JSON line from rank 0. Every rank must call
        it: peak memory (training's, up to the last step) is the largest over ranks, and
        each rank's is listed."""
        self.watchdog.stop()
        if self.tensorboard is not None:
            self.tensorboard.close()
        mem = torch.tensor(self.peak_mem, device=self.env.device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        mem_gib, mem_pct = mem.tolist()
        # A simulated rank is the only one there is: its peers' memory exists nowhere.
        per_rank = None if self.args.simulate else gather_floats(self.peak_mem[0], self.env.device)
        parts = self.step_parts()
        samples_per_sec, seconds = self.throughput()
        mfu = self._mfu(seconds)
        record = {
            "strategy": self.strategy,
            "world_size": self.env.world_size,
            "device": self.env.device.type,
            "gpu_name": torch.cuda.get_device_name(self.env.device) if self.env.device.type == "cuda" else None,
            "model": self.args.model,
            "params": count_params(self.cfg),
            "global_batch_size": self.args.global_batch_size,
            "seq_len": self.args.seq_len,
            "steps": self.args.steps,
            "start_step": self.start_step,
            "losses": self.losses,
            "grad_norms": self.grad_norms,
            "samples_per_sec": samples_per_sec,
            "tokens_per_sec": samples_per_sec * self.args.seq_len,
            "mfu": mfu,
            "peak_mem_gib": mem_gib,
            "mem_pct": mem_pct,
            "peak_mem_gib_per_rank": per_rank,
            "comm_pct": None,
            "comm_per_step": None if self.counted_step is None else self.comm.record(),  # the last step's, see steps()
            "simulated_rank": self.env.rank if self.args.simulate else None,  # world_size is then the simulated world's
            "step_seconds": seconds,
            "step_parts_seconds": parts,  # see StepClock
            "checkpoints_saved": self.ckpt.saves,
            "checkpoint_stall_seconds": self.ckpt.stall_seconds(),  # saves (left out of step_seconds), steps waiting for their copy (in it)
            "torch_version": torch.__version__,
            "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            **extra,
            "config": vars(self.args),
        }
        log(f"done | {samples_per_sec:.2f} samples/s | {record['tokens_per_sec']:.0f} tok/s | "
            f"MFU {'n/a' if mfu is None else f'{mfu:.1f}%'} | peak mem {mem_gib:.2f} GiB ({mem_pct:.0f}%)"
            + "".join(f" | {k} {v:.3g}" for k, v in extra.items() if isinstance(v, float)))
        if IS_MAIN and self.args.results:
            with open(self.args.results, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record


# ----------------------------------------------------------------------------
# Communication, counted: what one optimizer step hands the process group
# ----------------------------------------------------------------------------

# op -> (kind, which argument holds the collective's whole buffer). The buffer is
# nccl-tests' "size": an all-reduce's tensor, an all-gather's output, a reduce-scatter's
# input, one message of a send or receive; ring factors turn it into time on the wire.
# c10d ops carry their process group; functional collectives (DTensor's) its name.
_COLLECTIVES = {
    "c10d.allreduce_": ("all_reduce", 0), "c10d.allreduce_coalesced_": ("all_reduce", 0),
    "c10d.allgather_": ("all_gather", 0), "c10d._allgather_base_": ("all_gather", 0),
    "c10d.allgather_coalesced_": ("all_gather", 0), "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0),
    "c10d.reduce_scatter_": ("reduce_scatter", 1), "c10d._reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d.broadcast_": ("broadcast", 0), "c10d.reduce_": ("reduce", 0),
    "c10d.alltoall_": ("all_to_all", 1), "c10d.alltoall_base_": ("all_to_all", 1),
    "c10d.send": ("send", 0), "c10d.recv_": ("recv", 0), "c10d.recv_any_source_": ("recv", 0),
    "_c10d_functional.all_reduce": ("all_reduce", 0), "_c10d_functional.all_reduce_": ("all_reduce", 0),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", 0),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0), "_c10d_functional.all_gather_into_tensor_out": ("all_gather", 0),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", 0),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "_c10d_functional.all_to_all_single": ("all_to_all", 0),
    "_c10d_functional.broadcast": ("broadcast", 0), "_c10d_functional.broadcast_": ("broadcast", 0),
}


def _tensors(x):
    if is_traceable_wrapper_subclass(x):  # float8's tensors: count what travels, the float8 data and its scale
        return [t for name in x.__tensor_flatten__()[0] for t in _tensors(getattr(x, name))]
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _tensors(item)] if isinstance(x, (list, tuple)) else []


def _group_ranks(func_name, args):
    """The global ranks of the group a collective runs in."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if func_name.startswith("_c10d_functional."):
        name = args[-1]
    else:
        name = dist.ProcessGroup.unbox(next(a for a in args if isinstance(a, torch.ScriptObject))).group_name
    return tuple(dist.get_process_group_ranks(_resolve_process_group(name)))


def comm_kinds():
    """The counter's vocabulary (for tests and the sweep)."""
    return sorted({kind for kind, _ in _COLLECTIVES.values()})


class CommCounter:
    """Counts every collective and point-to-point transfer this rank starts while it is
    on: what it is, the ranks of its group, its dtype, and its buffer's bytes. It sees them at
    the dispatcher (a TorchDispatchMode, as torch's CommDebugMode), so DDP's reducer,
    FSDP's hooks, DTensor's redistributions and the pipeline's sends are all counted as
    they really run, not as a formula says they should. Costly per op, so TrainLog turns
    it on for one step only.

    Under --simulate it can also make a receive deliver ones where a fake one delivers
    nothing: a pipeline's first step agrees over receives that every stage was given its
    shapes (common.stage_shapes), and would otherwise read a garbage answer."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                dtensor = sys.modules.get("torch.distributed.tensor")
                if dtensor is not None and any(issubclass(t, dtensor.DTensor) for t in types):
                    return NotImplemented  # let DTensor turn itself into the collectives it needs
                out = func(*args, **(kwargs or {}))
                name = str(func.overloadpacket)
                if name in _COLLECTIVES:
                    counter.add(name, args)
                return out

        self.mode, self.totals, self.on, self.counting, self.fill_receives = Mode(), {}, False, False, False

    def add(self, name, args):
        kind, buffer_arg = _COLLECTIVES[name]
        tensors = _tensors(args[buffer_arg])
        if kind == "recv" and self.fill_receives:
            for t in tensors:
                t.fill_(1)
        if not self.counting:
            return
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if name.startswith("_c10d_functional.all_gather"):
            nbytes *= args[1]  # given the shard: the gathered buffer is group_size shards
        key = (kind, _group_ranks(name, args), str(tensors[0].dtype).removeprefix("torch.") if tensors else "none")
        calls, total = self.totals.get(key, (0, 0))
        self.totals[key] = (calls + 1, total + nbytes)

    def start(self, count, fill_receives=False):
        self.counting, self.fill_receives = count, fill_receives
        if count or fill_receives:
            self.on = True
            self.mode.__enter__()

    def stop(self):
        if self.on:
            self.on = self.counting = self.fill_receives = False
            self.mode.__exit__(None, None, None)

    def record(self):
        """One entry per (kind, group, dtype), for the results line."""
        return [{"kind": k, "group": list(g), "group_size": len(g), "dtype": d, "calls": c, "bytes": b}
                for (k, g, d), (c, b) in sorted(self.totals.items())]


class Profiler:
    """--profile DIR: a torch.profiler trace of 3 steps after the timing warm-up, one
    Chrome trace per rank (trace_rank<R>.json: Perfetto and chrome://tracing open it), and
    the op table the article reads its figures from, heaviest first by time on the device
    (CUDA), by self CPU time on a CPU: printed on rank 0, written by every rank beside
    its trace (ops_rank<R>.txt)."""

    def __init__(self, args, env):
        self.prof = None
        if not args.profile:
            return
        os.makedirs(args.profile, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if env.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        sort_by = "self_device_time_total" if env.device.type == "cuda" else "self_cpu_time_total"

        def done(prof):
            prof.export_chrome_trace(os.path.join(args.profile, f"trace_rank{env.rank}.json"))
            table = prof.key_averages().table(sort_by=sort_by, row_limit=25)
            with open(os.path.join(args.profile, f"ops_rank{env.rank}.txt"), "w") as f:
                f.write(table + "\n")
            log(table)

        schedule = torch.profiler.schedule(wait=args.timing_warmup_steps, warmup=1, active=3, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=done)

    def __enter__(self):
        if self.prof:
            self.prof.__enter__()
        return self

    def __exit__(self, *exc):
        if self.prof:
            self.prof.__exit__(*exc)

    def step(self):
        if self.prof:
            self.prof.step()


# ----------------------------------------------------------------------------
# Checkpoints (torch.distributed.checkpoint) and fault injection
# ----------------------------------------------------------------------------


class Checkpointer:
    """Sharded checkpoints: every rank writes its own part with torch.distributed.checkpoint.

    A checkpoint is written to step_N.partial/ and renamed to step_N/ only after every rank
    has finished, so a crash mid-save leaves the previous checkpoint the newest complete one.
    The last step is always saved, so a finished run started again has nothing to do.
    Resume takes the newest checkpoint that loads: one that does not (a truncated shard,
    garbled metadata) is moved aside to step_N.unreadable, said in one line, and the one
    before it is tried; nothing is ever deleted.

    The folder must be one every rank sees (a shared filesystem); rank 0 decides what is in
    it, so ranks never disagree over a directory listing. `model` must carry global
    parameter names (blocks keyed by global index), so ranks holding different parts never
    write the same name; optimizer state is keyed by those names too, which lets DCP
    reshard to another world size. Step, run and model shape are stored as tensors, but DCP
    reads its metadata with pickle: a checkpoint is trusted input, like code.

    The saves of --checkpoint-every are written behind training (dcp.async_save): training
    stops only while the state is copied to host memory (on a GPU, not even then: the copy
    runs on a side stream, and the next optimizer step waits for it), and a thread of DCP's
    writes it to disk over a gloo group of its own, then commits it. That copy costs host
    memory the size of this rank's state, kept for the next save. The last save, and one
    on SIGTERM, are written at once: the job ends next.
    """

    # What must match for a resume to continue the same run (the data position is step x batch).
    RUN_SHAPE = ("global_batch_size", "seed")
    MODEL_SHAPE = ("n_layers", "n_heads", "d_model", "vocab_size", "max_seq_len")
    # Each rank writes its part as this many files, by as many threads: on the H200 machine's
    # disk 8 threads wrote 6 GiB at 1.79 GB/s where 1 wrote 0.68; 16 gained nothing (1.81).
    WRITE_THREADS = 8

    def __init__(self, args, cfg, model, optimizer, scaler=None):
        self.args, self.cfg, self.dir, self.every = args, cfg, args.checkpoint_dir, args.checkpoint_every
        self.model, self.optimizer, self.scaler = model, optimizer, scaler
        self.start_step, self.save_seconds = 0, 0.0  # set by load(); time training stood still for saves, for TrainLog
        self.saves, self.staging_wait, self.background = 0, 0.0, None  # background: the save written behind training, done when committed
        if self.dir:  # imported only when used: DCP takes a second to load
            import torch.distributed.checkpoint as dcp
            import torch.distributed.checkpoint.state_dict as sd

            self.dcp, self.sd = dcp, sd
            self.options = sd.StateDictOptions(flatten_optimizer_state_dict=True)
        if self.dir and self.every:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            # Its own group: collectives of two threads must not interleave on one.
            self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
            class KeptStager(DefaultStager):
                """One host copy of the state, reused by every save and released by us alone:
                torch 2.11 closes the copier inside a stager once a save is written, which
                leaves it unable to stage the next (KeyError in its deepcopy)."""

                def __init__(self, options):
                    super().__init__(options)
                    self._state_dict_stager.close = lambda: None

                def close(self):
                    pass

                def release(self):
                    del self._state_dict_stager.close  # its class's own close again
                    DefaultStager.close(self)

            cuda = any(p.is_cuda for p in model.parameters())
            self.stager = KeptStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=cuda, use_non_blocking_copy=cuda))
            optimizer.register_step_pre_hook(self._wait_for_staging)  # the step would change what is being copied

    def _wait_for_staging(self, *_):
        start = time.perf_counter()
        self.stager.synchronize_staging()
        self.staging_wait += time.perf_counter() - start

    def _extra(self, step):
        extra = {"step": torch.tensor(step), "steps": torch.tensor(self.args.steps)}
        extra |= {k: torch.tensor(getattr(self.args, k)) for k in self.RUN_SHAPE}
        extra |= {f"model.{k}": torch.tensor(getattr(self.cfg, k)) for k in self.MODEL_SHAPE}
        if self.scaler is not None:
            extra |= {f"scaler.{k}": torch.tensor(v) for k, v in self.scaler.state_dict().items()}
        return extra

    def _state(self, step):
        state = {
            "model": self.sd.get_model_state_dict(self.model),
            "optim": self.sd.get_optimizer_state_dict(self.model, self.optimizer, options=self.options),
        }
        return torch.utils._pytree.tree_map(_plain, state) | {"extra": self._extra(step)}

    def _on_rank0(self, fn):
        """fn() evaluated on rank 0 and shared with every rank."""
        box = [fn() if IS_MAIN else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _complete(self):
        """The committed checkpoints, newest first."""
        if not os.path.isdir(self.dir):
            return []
        steps = sorted((int(m.group(1)) for d in os.listdir(self.dir) if (m := re.fullmatch(r"step_(\d+)", d))), reverse=True)
        return [os.path.join(self.dir, f"step_{s:08d}") for s in steps]

    def _check_shape(self, path, extra):
        for k in self.MODEL_SHAPE:
            check(int(extra[f"model.{k}"]) == getattr(self.cfg, k), f"{path} holds a model with {k} {int(extra[f'model.{k}'])}, "
                  f"this run's has {getattr(self.cfg, k)} (--model {self.args.model}, --vocab-size): resume with the same, or use another --checkpoint-dir")
        for k in self.RUN_SHAPE:
            check(int(extra[k]) == getattr(self.args, k), f"{path} was trained with --{k.replace('_', '-')} {int(extra[k])}: "
                  f"resume with the same, or use another --checkpoint-dir")

    def load(self):
        """Restore the newest checkpoint that loads; return the step to continue from (0 if none)."""
        set_aside = []
        for path in self._on_rank0(self._complete) if self.dir else []:
            logging.disable(logging.WARNING)  # DCP logs each failed read with a traceback on the root logger
            try:
                extra = {"extra": {k: torch.zeros_like(v) for k, v in self._extra(0).items()}}
                self.dcp.load(extra, checkpoint_id=path)  # first only what it is: refuse another model before its tensors
                self._check_shape(path, extra["extra"])
                state = self._state(0)
                self.dcp.load(state, checkpoint_id=path)  # DCP raises on every rank when any rank's read fails
            except ConfigError:
                raise
            except (Exception, self.dcp.CheckpointException) as e:  # unreadable (DCP's error is a BaseException): set it aside, try the one before
                aside = self._on_rank0(lambda: self._set_aside(path))
                log(f"skipping {path}: it does not load ({_load_error(e)}); moved to {aside}, trying the one before")
                set_aside.append(aside)
                continue
            finally:
                logging.disable(logging.NOTSET)
            extra = state["extra"]
            self.sd.set_model_state_dict(self.model, state["model"])
            self.sd.set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=self.options)
            if self.scaler is not None:
                self.scaler.load_state_dict({k.removeprefix("scaler."): v.item() for k, v in extra.items() if k.startswith("scaler.")})
            step = self.start_step = int(extra["step"])
            log(f"resumed from {path} at step {step}" + ("" if int(extra["steps"]) == self.args.steps else
                f" (it was run for --steps {int(extra['steps'])}: the learning-rate schedule now stretches to {self.args.steps})"))
            if step >= self.args.steps:
                log(f"nothing left to train: --steps {self.args.steps}")
            return step
        # DCP loads in place: a load that failed part-way may have changed the weights.
        check(not set_aside, f"no checkpoint in {self.dir} loads ({', '.join(set_aside)} set aside), and the failed load may have "
                             "changed this run's weights: launch again to train from step 0")
        return 0

    @staticmethod
    def _set_aside(path):
        aside, n = f"{path}.unreadable", 1
        while os.path.exists(aside):
            n += 1
            aside = f"{path}.unreadable-{n}"
        os.rename(path, aside)
        return aside

    def maybe_save(self, step, force=False):
        """Save after `step` optimizer steps if it is due: every --checkpoint-every steps
        (behind training), after the last step, or when forced (SIGTERM)."""
        if self.background is not None and self.background.done():
            self.wait()  # raises here, not steps later, if the background save failed
        ends = force or step == self.args.steps
        if not self.dir or not (ends or (self.every and step % self.every == 0)):
            return
        t0 = time.perf_counter()
        self.wait()  # one save at a time, committed in order
        final = os.path.join(self.dir, f"step_{step:08d}")
        if self._on_rank0(lambda: os.path.isdir(final)):
            return
        if ends:
            self.dcp.save(self._state(step), storage_writer=self._writer(final))
            self._commit(final, step, dist.group.WORLD)
            if self.every:
                self.stager.release()  # its host copy of the state is not needed again
        else:
            response = self.dcp.async_save(self._state(step), storage_writer=self._writer(final), process_group=self.group,
                                           async_stager=self.stager)
            if not self.saves:
                # The first staging pins its host copy (cudaHostRegister; 2.5b: 32 GB, ~14 s), which
                # holds the CUDA driver's lock: training's kernel launches would stand still behind
                # it, uncounted. Waiting here counts it; later saves reuse the pinned copy.
                self.stager.synchronize_staging()
            written = getattr(response, "upload_completion", response)  # a Future, or with async staging a pair of them
            self.background = committed = Future()

            def commit(written):
                try:
                    written.result()
                    self._commit(final, step, self.group)
                    log(f"saved {final} (written behind training)")
                    committed.set_result(None)
                except BaseException as e:  # DCP's CheckpointException is one
                    committed.set_exception(e)

            written.add_done_callback(commit)  # in DCP's thread, once this rank's part is on disk
        seconds = time.perf_counter() - t0
        self.save_seconds += seconds
        self.saves += 1
        log(f"saved {final} in {seconds:.1f} s" if ends else f"saving {final} behind training (it stood still {seconds:.2f} s)")

    def _writer(self, final):
        return self.dcp.FileSystemWriter(final + ".partial", thread_count=self.WRITE_THREADS)

    def _commit(self, final, step, group):
        fault_point("save", step)
        dist.barrier(group=group)  # every rank's part is on disk
        if IS_MAIN:
            os.rename(final + ".partial", final)  # the commit: from now on resume sees it
        dist.barrier(group=group)

    def wait(self):
        """Until the save being written behind training, if any, is committed; raises if it failed."""
        if self.background is not None:
            background, self.background = self.background, None
            background.result()

    def stall_seconds(self):
        """How long training stood still for checkpoints: saves, and steps waiting for a copy."""
        return self.save_seconds + self.staging_wait


def _plain(value):
    """The high-precision tensor inside torchao's float8 weight wrapper (FSDP's float8
    all-gather), as a view of the same storage: a checkpoint then holds plain tensors
    that a bf16 run loads too, and that load in place into the wrapped weights."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) and hasattr(value._local_tensor, "_tensor"):
        return DTensor.from_local(value._local_tensor._tensor, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())
    return value._tensor if isinstance(value, torch.Tensor) and hasattr(value, "_tensor") else value


def _load_error(e):
    """What failed in a checkpoint load, in a few words: DCP's own exception gathers
    every rank's, and the first says enough."""
    rank = None
    if hasattr(e, "failures") and e.failures:
        rank, (e, _) = next(iter(e.failures.items()))
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}{'' if rank is None else f' on rank {rank}'}{': ' + text[0][:160] if text else ''}"


# Where each injectable fault strikes; see fault_point.
_FAULT_PLACES = {"kill": "step", "hang": "step", "raise": "step", "nan": "loss", "kill-in-save": "save", "raise-in-save": "save",
                 "slow-save": "save"}


def fault_point(where, step):
    """Fault injection for the tests, from the environment: TRAIN_FAULT=KIND:STEP[:RANK].
    kill: SIGKILL during STEP; hang: stop answering during STEP; raise: an exception
    nobody catches (a bug) during STEP; nan: the loss of STEP
    becomes NaN; kill-in-save: SIGKILL after writing the checkpoint taken after STEP,
    before it is committed; raise-in-save: a write that fails there (a full disk, say);
    slow-save: a write that takes 2 s more there. STEP counts from 1, as in the log; RANK defaults to every
    rank. Only on a job's first attempt, so an elastic restart runs clean."""
    spec = os.environ.get("TRAIN_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    kind, at, *rank = spec.split(":")
    if _FAULT_PLACES.get(kind) != where or int(at) != step or (rank and int(rank[0]) != RANK):
        return False
    print(f"fault injection: {kind} on rank {RANK} at step {step}", file=sys.stderr, flush=True)
    if kind in ("kill", "kill-in-save"):
        os.kill(os.getpid(), signal.SIGKILL)
    if kind in ("raise", "raise-in-save"):
        raise RuntimeError(f"fault injection: an uncaught error at step {step}")
    if kind == "slow-save":
        time.sleep(2)
    if kind == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a hung peer still dies when torchrun ends the job
        while True:
            time.sleep(60)
    return True


# ----------------------------------------------------------------------------
# Pipeline helpers: layer splits (also model_parallel_train.py), stages, schedules and
# their timing, shared by pipeline_train.py and hybrid_train.py
# ----------------------------------------------------------------------------

# --schedule name -> class in torch.distributed.pipelining.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",  # all forwards, then all backwards
    "1f1b": "Schedule1F1B",  # one forward, one backward: fewer activations alive
    "interleaved-1f1b": "ScheduleInterleaved1F1B",  # several stages per rank: smaller bubble
    "zero-bubble": "ScheduleInterleavedZeroBubble",  # backward split into input and weight grads
    "zbv": "ScheduleZBVZeroBubble",  # zero bubble, two stages per rank in a V
}
ZERO_BUBBLE = {"zero-bubble", "zbv"}


def add_pipeline_args(parser):
    """The pipeline's flags, the same in pipeline_train.py and hybrid_train.py."""
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default: 1f1b)")
    parser.add_argument("--micro-batches", type=positive, default=4,
                        help="micro-batches each pipeline's share of a step is cut into: the article's `chunks` (default: 4)")
    parser.add_argument("--stages-per-rank", type=positive,
                        help="stages each rank holds; interleaved and zero-bubble schedules need 2 or more (default: 1, or 2 for those)")
    parser.add_argument("--split", type=block_counts, help="blocks per stage, comma-separated, e.g. 3,5 (default: even)")


def split_layers(n_layers, n_parts, split=None):
    """Consecutive block ranges, one per part: even by default (earlier parts take the
    remainder), or as given by `split`, a list of blocks per part (--split 3,5)."""
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


def stages_of_rank(schedule, pp_rank, pp_size, stages_per_rank):
    """Global indices of the stages a rank holds: loop schedules put stage s on rank
    s % pp; the V schedule puts stages r and 2·pp-1-r on rank r, so the last stage sits
    beside the first and the loss's gradient turns around without a transfer."""
    if schedule == "zbv":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def check_pipeline_args(args, pp_size):
    """Stages per rank and schedule must fit each other; returns the number of stages."""
    multi = args.schedule in ("interleaved-1f1b", "zero-bubble", "zbv")
    if args.stages_per_rank is None:
        args.stages_per_rank = 2 if multi else 1
    check(multi or args.stages_per_rank == 1, f"--schedule {args.schedule} runs one stage per rank; use interleaved-1f1b or zero-bubble for --stages-per-rank {args.stages_per_rank}")
    check(args.schedule != "zbv" or args.stages_per_rank == 2, "--schedule zbv places exactly 2 stages per rank")
    # Seen with gloo: torch 2.11 fails ("Pair is not connected") where the V hands
    # activations between a rank's own two stages; 2.13 runs it.
    check(not (args.schedule == "zbv" and dist.get_backend() == "gloo" and torch_version() < (2, 13)),
          f"--schedule zbv on gloo needs torch 2.13 or newer (this is {torch.__version__}): use NCCL or another schedule")
    check(not multi or args.stages_per_rank >= 2, f"--schedule {args.schedule} needs --stages-per-rank of at least 2")
    check(not (args.compile and args.schedule in ZERO_BUBBLE), f"--schedule {args.schedule} splits backward by hand, which compiled blocks do not support: drop --compile")
    refuse_fp16(args, "the loss scaler's inf check would have to agree across pipeline stages")
    return pp_size * args.stages_per_rank


def build_stage_module(cfg, args, stage, n_stages, device, fsdp=False):
    """The blocks of one pipeline stage; the first stage also embeds, the last also holds
    the final norm and head. Weights equal the whole model's at the same place."""
    layers = split_layers(cfg.n_layers, n_stages, args.split)[stage]
    return build_model(cfg, device, args, layers, embed=stage == 0, head=stage == n_stages - 1, fsdp=fsdp)


def stage_shapes(args, cfg, stage, n_stages, micro_batch, device, activation_dtype=torch.float32):
    """Under --simulate, what a stage receives and sends, given up front: the pipeline
    otherwise learns it from a first exchange that a fake process group never delivers.
    Tokens into the first stage, the residual stream between stages, logits out of the
    last (their matmul's dtype under autocast). Empty, so the stage infers it, otherwise."""
    if not args.simulate:
        return {}
    from torch.distributed.pipelining import PipelineStage

    stream = torch.zeros(micro_batch, args.seq_len, cfg.d_model, dtype=activation_dtype, device=device)
    first, last = stage == 0, stage == n_stages - 1
    logits_dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    shapes = {"input_args": torch.zeros(micro_batch, args.seq_len, dtype=torch.long, device=device) if first else stream,
              "output_args": torch.zeros(micro_batch, args.seq_len, cfg.vocab_size, dtype=logits_dtype, device=device) if last else stream,
              # Newer torch also wants the gradients' shapes up front (the same as the stream's).
              "input_grads": None if first else stream, "output_grads": None if last else stream}
    accepted = inspect.signature(PipelineStage.__init__).parameters
    return {k: v for k, v in shapes.items() if k in accepted}


def make_schedule(args, stages, n_microbatches, loss):
    """Build the schedule once; its own rules on micro-batches come back as one line.
    scale_grads=False: `loss` must already be normalised by the global batch, since the
    schedule's own division by n_microbatches would run again at every grad-accum step."""
    import torch.distributed.pipelining as pipelining

    cls = getattr(pipelining, SCHEDULES[args.schedule])
    try:
        if len(stages) == 1 and args.schedule in ("gpipe", "1f1b"):
            return cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
        return cls(stages, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ConfigError(f"--schedule {args.schedule} cannot run {n_microbatches} micro-batches over {stages[0].num_stages} stages: {e}") from None


def merged_stages(modules):
    """This rank's stage modules under the whole model's parameter names (blocks keep
    their global index), for checkpoints: stages on different ranks never share a name."""
    merged = nn.Module()
    merged.blocks = nn.ModuleDict({i: b for m in modules for i, b in m.blocks.items()})
    for m in modules:
        for name in ("tok_emb", "pos_emb", "norm", "head"):
            if getattr(m, name) is not None:
                setattr(merged, name, getattr(m, name))
    return merged


def theoretical_bubble_pct(schedule, pp_size, n_microbatches, stages_per_rank):
    """Idle share of an ideal pipeline with equal stages and free transfers: (p-1)/(m+p-1)
    for GPipe and 1F1B, (p-1)/(v·m+p-1) interleaved over v stages per rank. None for the
    zero-bubble schedules, whose bubble depends on how weight gradients fill it."""
    if schedule in ZERO_BUBBLE:
        return None
    return 100 * (pp_size - 1) / (stages_per_rank * n_microbatches + pp_size - 1)


def pipeline_report(timer, tlog, args, schedule, modules, pp_size, device):
    """Measured busy % per rank and bubble beside the schedule's theory: the results
    fields pipeline_train.py and hybrid_train.py both report (a collective)."""
    busy = gather_floats(timer.busy_pct(tlog.timed), device)
    blocks = [int(b) for b in gather_floats(sum(len(m.blocks) for m in modules), device)]
    utilisation = sum(busy) / len(busy)
    theory = theoretical_bubble_pct(args.schedule, pp_size, args.micro_batches, args.stages_per_rank)
    log(f"busy % per rank {busy}; bubble {100 - utilisation:.1f}% measured, {'n/a' if theory is None else f'{theory:.1f}%'} "
        f"in theory for {args.schedule} with {pp_size} ranks x {args.stages_per_rank} stages and {args.micro_batches} micro-batches")
    return {"schedule": args.schedule, "micro_batches": args.micro_batches, "stages_per_rank": args.stages_per_rank,
            "schedule_class": type(schedule).__name__, "actions_last_step": timer.last_actions, "blocks_per_rank": blocks,
            "action_seconds": timer.mean_seconds(tlog.timed), "pipeline_order": pipeline_order(schedule, args, pp_size),
            "busy_pct_per_rank": busy, "utilisation_pct": utilisation, "bubble_pct": 100 - utilisation, "bubble_pct_theory": theory}


def pipeline_order(schedule, args, pp_size):
    """Every pipeline rank's compute actions in the order its schedule runs them, as
    "F1:0": from the schedule itself for the multi-stage schedules (their runtime executes
    that table), from GPipe's and 1F1B's definitions for the single-stage ones (newer
    torch tabulates those too, but the table is not what runs: it is off by one on the
    last stage in 2.13)."""
    if args.schedule not in ("gpipe", "1f1b"):
        order = schedule.pipeline_order
        return {rank: [f"{a.computation_type.value}{a.stage_index}:{a.microbatch_index}" for a in actions
                       if a is not None and a.computation_type.value in ("F", "B", "I", "W")] for rank, actions in order.items()}
    m, orders = args.micro_batches, {}
    for rank in range(pp_size):
        warmup = m if args.schedule == "gpipe" else min(m, pp_size - rank)  # 1F1B: a forward for every stage ahead
        order = [f"F{rank}:{i}" for i in range(warmup)]
        for i in range(m):  # then one backward, one forward
            order += [f"B{rank}:{i}"] + ([f"F{rank}:{warmup + i}"] if warmup + i < m else [])
        orders[rank] = order
    return orders


class ComputeTimer:
    """Time this rank's compute (each micro-batch's forward, backward and weight gradient,
    and the optimizer step), to measure utilisation rather than assume it. CUDA events on
    a GPU: the host only queues the work. Also keeps the order in which the schedule ran
    a step's actions on this rank ("F1:0" is stage 1's forward of micro-batch 0; B a whole
    backward, I its input-gradient half, W its weight-gradient half), and each kind's
    time, from which run_all.sh --simulate replays a schedule."""

    def __init__(self, device, optimizer, stages=()):
        self.cuda = device.type == "cuda"
        self.spans, self.busy, self.seconds_by_kind, self.actions, self.last_actions = [], [], [], [], []
        for stage in stages:
            for name, letter in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
                setattr(stage, name, self.timed(getattr(stage, name), letter, stage.stage_index))
        optimizer.register_step_pre_hook(lambda *_: self.spans.append((clock_mark(self.cuda), None, "optimizer")))
        optimizer.register_step_post_hook(lambda *_: self.spans.append((self.spans.pop()[0], clock_mark(self.cuda), "optimizer")))

    def timed(self, fn, letter, stage_index=None):
        def wrapper(*args, **kwargs):
            kind = "I" if letter == "B" and not kwargs.get("full_backward", True) else letter
            if stage_index is not None:  # args[0] is the micro-batch
                self.actions.append(f"{kind}{stage_index}:{args[0]}")
            start = clock_mark(self.cuda)
            try:
                return fn(*args, **kwargs)
            finally:
                self.spans.append((start, clock_mark(self.cuda), kind))
        return wrapper

    def end_step(self, step_seconds):
        """Call after each step, once its device work has finished (TrainLog.end_step)."""
        by_kind = {}
        for start, end, kind in self.spans:
            seconds = seconds_between(start, end)
            total, count = by_kind.get(kind, (0.0, 0))
            by_kind[kind] = (total + seconds, count + 1)
        self.spans, self.last_actions, self.actions = [], self.actions, []
        self.busy.append(sum(total for total, _ in by_kind.values()) / step_seconds)
        self.seconds_by_kind.append(by_kind)

    def busy_pct(self, timed):
        """Mean busy % of this rank over the steps `timed` (TrainLog.timed) selects."""
        busy = timed(self.busy)
        return 100 * sum(busy) / len(busy)

    def mean_seconds(self, timed):
        """Mean seconds of one action of each kind (F, B, I, W, optimizer) over the timed steps."""
        steps = timed(self.seconds_by_kind)
        kinds = {kind for step in steps for kind in step}
        return {kind: sum(s[kind][0] for s in steps if kind in s) / sum(s[kind][1] for s in steps if kind in s) for kind in kinds}
