"""A strategy script (STRATEGY, a file name in the repository) run as __main__ under what
INSTRUMENT names, which prints one line at the end for the test to read:

- dynamo: torch.compile with the backend BACKEND names (default eager: dynamo traces as
  for inductor, with no code generation; aot_eager adds AOTAutograd, which takes DTensor
  apart, and runs the graphs it makes), then `INSTRUMENT {dynamo's frame and graph counters}`.
- flops: `INSTRUMENT {op: FLOPs}` of the matmuls this rank computes: torch's FlopCounterMode
  formulas on local tensors only (FlopCounterMode itself counts a DTensor op at its global
  shape, and DTensor's sharding propagation runs each op once more on fake tensors)."""

import json
import os
import runpy
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
script = str(ROOT / os.environ["STRATEGY"])
sys.argv[0], sys.path[0] = script, str(ROOT)


def run(mode=nullcontext()):
    try:
        with mode:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0


if os.environ["INSTRUMENT"] == "dynamo":
    from torch._dynamo.utils import counters

    compile_ = torch.compile
    backend = os.environ.get("BACKEND", "eager")
    torch.compile = lambda *args, **kwargs: compile_(*args, **{**kwargs, "backend": backend})
    code = run()
    report = {"frames": counters["frames"].get("ok", 0), "graphs": counters["stats"].get("unique_graphs", 0),
              "graph_breaks": sum(counters["graph_break"].values())}
else:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    formulas, report = FlopCounterMode(display=False).flop_registry, {}

    class LocalFlops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor turns itself into local ops, which come back here
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket in formulas and not any(issubclass(t, FakeTensor) for t in types):
                name = str(func._overloadpacket)
                report[name] = report.get(name, 0) + formulas[func._overloadpacket](*args, **(kwargs or {}), out_val=out)
            return out

    code = run(LocalFlops())
print("INSTRUMENT", json.dumps(report), flush=True)
sys.exit(code)
