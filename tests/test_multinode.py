"""The multi-node launch README.md documents, with two "nodes" on this machine: two
`torchrun --nnodes 2` launchers meeting at a c10d rendezvous on a localhost port must
train as one process does, and a launcher whose second node never comes must give up
within the rendezvous timeout. The real torchrun command: here the launcher is under test."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from harness import ROOT, TINY, assert_losses_match, reference
from test_errors import processes_marked


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def marker():
    """An environment variable that the launchers, and all they start, inherit: what is
    left of them is found in /proc (torchrun puts its workers in sessions of their own, so
    no process group holds them all), and killed after a failed test."""
    marker = f"TEST_MARKER={uuid.uuid4()}"
    yield marker
    for pid in processes_marked(marker):
        os.kill(pid, signal.SIGKILL)


def start_node(node, folder, marker, port, args=(), torchrun_args=(), env=None):
    """One node's launcher: the README's command, one process per node, the head's endpoint
    on localhost. Its stdout and stderr go to nodeN.out and nodeN.err in folder."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
           f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=job1", *torchrun_args, str(ROOT / "ddp_train.py"), *TINY, *map(str, args)]
    name, value = marker.split("=")
    # One thread a worker, as torchrun sets it when a node runs several: two nodes share 2 cores here.
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", name: value, **(env or {})}
    with open(folder / f"node{node}.out", "w") as out, open(folder / f"node{node}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, env=full_env)


def test_two_nodes_train_as_one_process(tmp_path, marker):
    port, results = free_port(), tmp_path / "results.jsonl"
    # Both nodes run the same command: whichever binds the port first hosts the store.
    # LOGLEVEL=INFO: each launcher then logs the ranks the rendezvous gave its node.
    nodes = [start_node(node, tmp_path, marker, port, ["--results", results], env={"LOGLEVEL": "INFO"}) for node in range(2)]
    codes = [node.wait(timeout=120) for node in nodes]
    out, err = ([(tmp_path / f"node{node}.{kind}").read_text() for node in range(2)] for kind in ("out", "err"))
    assert codes == [0, 0], err
    ranks = [re.findall(r"global_ranks=\[(\d+)\]$", log, re.M) for log in err]
    assert sorted(ranks) == [["0"], ["1"]], "each node must run one rank of one job"
    head = ranks.index(["0"])
    assert "step     4/4" in out[head] and "step " not in out[1 - head], out  # rank 0 prints on its own node only
    (run,) = [json.loads(line) for line in results.read_text().splitlines()]
    assert run["world_size"] == 2
    assert_losses_match(run, reference())
    assert processes_marked(marker) == []


def test_a_node_that_never_comes_ends_the_launch_within_the_rendezvous_timeout(tmp_path, marker):
    # c10d's rendezvous waits join_timeout (600 s unless set) for every node. What ends the
    # launch is torchrun's own uncaught error: a traceback that nothing in this repository
    # prints or can shorten, whose last line names the cause.
    join_timeout = 1
    start = time.monotonic()
    head = start_node(0, tmp_path, marker, free_port(), torchrun_args=[f"--rdzv_conf=join_timeout={join_timeout}"])
    code = head.wait(timeout=60)
    elapsed = time.monotonic() - start
    out, err = (tmp_path / "node0.out").read_text(), (tmp_path / "node0.err").read_text()
    assert code == 1 and out == "", err
    assert err.splitlines()[-1] == "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", err
    assert "ddp_train.py" not in err, "no worker may start without its peer"
    # At least the timeout it was given; the rest is the launcher's start and shutdown.
    assert join_timeout <= elapsed < join_timeout + 30, elapsed
    assert processes_marked(marker) == []
