"""A stand-in for a *_train.py script in the sweep's tests, copied as each strategy's:
it trains nothing. It appends its argv to argv.jsonl beside it and writes the results
line a real run would (the fields sweep_report reads; its config parsed from argv as the
script's parser would, refusing a flag the script does not have), at a made-up speed.
stub.json beside it steers it, by script name: "fail" (fails at once), "hang" (writes
its pid into hung.<pid> and sleeps), "oom" (runs out of memory unless checkpointed, at
more than one rank), and "slower" ({text in its argv: factor on its step time}).
Imported (sweep_report imports pipeline_train), it does nothing."""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.basename(sys.argv[0]).removesuffix("_train.py")
STRATEGY = {"tensor_parallel": "tp", "context_parallel": "cp"}.get(SCRIPT, SCRIPT)
KNOBS = json.load(open(os.path.join(HERE, "stub.json"))) if os.path.exists(os.path.join(HERE, "stub.json")) else {}
SWITCHES = {"--compile", "--activation-checkpointing", "--count-comm"} | ({"--sequence-parallel"} if STRATEGY == "tp" else set())


def main():
    # The script's defaults, and which of its flags take whole numbers.
    config = {"model": "tiny", "seq_len": None, "num_workers": 2, "steps": 20, "global_batch_size": 8, "grad_accum": 1, "activation_checkpointing": False,
              "compile": False, "count_comm": False, "float8": None, "device": "auto", "simulate": None, "simulate_rank": 0, "profile": None,
              "results": None}
    config.update({"pipeline": {"schedule": "1f1b", "micro_batches": 4, "stages_per_rank": None},
                   "hybrid": {"pp": 2, "schedule": "1f1b", "micro_batches": 4, "stages_per_rank": None},
                   "tp": {"dp": 1, "sequence_parallel": False}, "cp": {"cp": None}}.get(STRATEGY, {}))
    whole = {"seq_len", "num_workers", "steps", "global_batch_size", "grad_accum", "simulate", "simulate_rank", "micro_batches", "stages_per_rank", "pp", "dp", "cp"}

    argv = sys.argv[1:]
    args = list(argv)
    while args:
        flag = args.pop(0)
        key = flag[2:].replace("-", "_")
        if flag in SWITCHES:
            config[key] = True
        elif flag.startswith("--") and key in config and f"--{key.replace('_', '-')}" not in SWITCHES | {"--sequence-parallel"} and args:
            value = args.pop(0)
            config[key] = int(value) if key in whole else value
        else:
            print(f"error: unrecognized arguments: {flag} (see --help)", file=sys.stderr)
            sys.exit(2)
    if STRATEGY in ("pipeline", "hybrid") and config["stages_per_rank"] is None:
        config["stages_per_rank"] = 2 if config["schedule"] in ("interleaved-1f1b", "zero-bubble", "zbv") else 1

    world = config["simulate"] or int(os.environ.get("WORLD_SIZE", "1"))
    rank = config["simulate_rank"] if config["simulate"] else 0
    with open(os.path.join(HERE, "argv.jsonl"), "a") as f:
        f.write(json.dumps({"script": SCRIPT, "argv": argv, "world": world, "threads": os.environ.get("OMP_NUM_THREADS")}) + "\n")

    if SCRIPT in KNOBS.get("hang", []):
        open(os.path.join(HERE, f"hung.{os.getpid()}"), "w").close()
        time.sleep(3600)
    if SCRIPT in KNOBS.get("fail", []):
        print("error: broken on purpose", file=sys.stderr)
        sys.exit(2)
    if SCRIPT in KNOBS.get("oom", []) and world > 1 and not config["activation_checkpointing"]:
        print("error: rank 0 ran out of memory (CUDA out of memory. Tried to allocate 2.00 GiB): try --activation-checkpointing", file=sys.stderr)
        sys.exit(1)

    factor = 1.0
    for text, slower in KNOBS.get("slower", {}).items():
        if text in " ".join(argv):
            factor *= slower
    action = 0.01 * factor  # a forward's seconds; a backward takes two
    record = {"strategy": STRATEGY, "world_size": world, "device": "cuda" if config["device"] == "cuda" else "cpu",
              "gpu_name": "NVIDIA H100 80GB HBM3 (stub)" if config["device"] == "cuda" else None, "model": config["model"], "params": 1000,
              "global_batch_size": config["global_batch_size"], "seq_len": config["seq_len"] or 64, "steps": config["steps"], "start_step": 0,
              "losses": [1.0] * config["steps"], "mfu": None, "peak_mem_gib": 1.0, "mem_pct": 10.0, "comm_pct": None, "comm_per_step": [],
              "simulated_rank": rank if config["simulate"] else None, "torch_version": "stub", "config": config}
    step = 0.1 * factor
    if STRATEGY in ("pipeline", "hybrid", "model_parallel"):
        pp = config.get("pp", 2) if STRATEGY == "hybrid" else world
        per_rank, m = config.get("stages_per_rank", 1), config.get("micro_batches", 1)
        # Each stage every micro-batch forward, then each backward, last stage first: an order
        # that waits on no rank it should not.
        orders = {str(r): [f"F{r + k * pp}:{i}" for k in range(per_rank) for i in range(m)]
                  + [f"B{r + k * pp}:{i}" for k in reversed(range(per_rank)) for i in range(m)] for r in range(pp)}
        step = len(orders[str(0)]) * 1.5 * action + 0.01
        record.update(action_seconds={"F": action, "B": 2 * action, "optimizer": 0.001}, pipeline_order=orders, schedule=config.get("schedule"))
        if STRATEGY == "hybrid":
            record["mesh"] = {"pp": pp, "dp": world // pp}
    if STRATEGY == "tp":
        record["mesh"] = {"dp": config["dp"], "tp": world // config["dp"]}
    record.update(step_seconds=step, samples_per_sec=config["global_batch_size"] / step)
    if config["results"]:
        with open(config["results"], "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
