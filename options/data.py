"""--data FILE: train on a flat binary file of uint16 token ids (nanoGPT's train.bin)
instead of the synthetic Markov stream. common.parse_args checks the file whole with
check_token_file(); common.make_batches reads it through TokenFile.
"""

import os
import random

import numpy as np
import torch
from torch.utils.data import Dataset

from common import check


def check_args(args, cfg):
    check_token_file(args.data, cfg.vocab_size, args.seq_len)


def check_token_file(path, vocab_size, seq_len):
    """Refuse a --data file that could fail mid-run: missing, not a file, unreadable, an odd
    byte count, too short for one sample, or holding ids beyond the vocabulary."""
    check(os.path.exists(path), f"--data {path} does not exist")
    check(os.path.isfile(path), f"--data {path} is not a file (give a flat file of uint16 token ids)")
    check(os.access(path, os.R_OK), f"--data {path} is not readable")
    size = os.path.getsize(path)
    check(size % 2 == 0, f"--data {path} holds {size} bytes, an odd count: not a file of uint16 token ids")
    check(size // 2 >= seq_len + 2, f"--data {path} holds {size // 2} tokens; one sample needs --seq-len + 2 = {seq_len + 2}")
    largest = int(np.memmap(path, dtype=np.uint16, mode="r").max())  # reads the file without copying it
    check(largest < vocab_size, f"--data {path} holds token id {largest}, beyond the vocabulary of {vocab_size}: "
          f"set --vocab-size {largest + 1} or more")


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
