"""Every option of every script is checked by what it changes, not by its echo in the
results line: this file holds the map from each option to the tests that observe its
effect (collectives, placements, schedule, memory, files), and fails when a script gains
an option the map does not name, or names a test that does not exist."""

import argparse
import ast
import importlib
import json
import os
import sys
from pathlib import Path

import pytest

import common
from harness import ROOT, run_script

SCRIPTS = ["ddp_train.py", "model_parallel_train.py", "pipeline_train.py", "hybrid_train.py", "fsdp_train.py", "tensor_parallel_train.py", "context_parallel_train.py"]
REPORTING_ONLY = "reporting only"

# option -> the tests that fail when it is wired to nothing, or why no test can.
EFFECTS = {
    # common.py's, in every script
    "--help": f"{REPORTING_ONLY}: argparse's own",
    "--model": ["test_options.py::test_model_options_shape_the_model"],
    "--vocab-size": ["test_options.py::test_model_options_shape_the_model", "test_checkpoint.py::test_a_finished_run_has_nothing_to_do_and_another_batch_is_refused"],
    "--seq-len": ["test_options.py::test_model_options_shape_the_model", "test_boundaries.py::test_exactly_enough_passes_and_one_short_is_refused_in_one_line"],
    "--data": ["test_common.py::test_data_file_feeds_the_batches", "test_common.py::test_token_file_windows_and_its_checks",
               "test_boundaries.py::test_exactly_enough_passes_and_one_short_is_refused_in_one_line"],
    "--num-workers": ["test_common.py::test_dataloader_workers_run_outside_the_trainers_process_group", "test_errors.py::test_an_uncaught_error_ends_the_job_and_its_dataloader_workers"],
    "--steps": ["test_oracle.py", "test_ddp.py::test_results_line_has_every_field"],
    "--global-batch-size": ["test_oracle.py", "test_run_all.py"],
    "--grad-accum": ["test_oracle.py", "test_ddp.py::test_ddp_two_ranks_match_single_process", "test_fsdp.py::test_fsdp_matches_single_process"],
    "--lr": ["test_oracle.py"],
    "--lr-warmup-steps": ["test_oracle.py"],
    "--weight-decay": ["test_oracle.py"],
    "--grad-clip": ["test_oracle.py", "test_ddp.py::test_ddp_clipping_matches_when_it_acts"],
    "--seed": ["test_common.py::test_a_sample_depends_only_on_seed_and_index"],
    "--dtype": ["test_common.py::test_dtype_sets_the_matmul_precision_under_autocast", "test_fsdp.py::test_bf16_gathers_weights_in_bf16_and_reduces_gradients_in_fp32",
                "test_simulate.py::test_bf16_crosses_the_wire_where_the_strategy_computes_in_it"],
    "--activation-checkpointing": ["test_common.py::test_activation_checkpointing_keeps_only_each_blocks_input", "test_tensor_parallel.py::test_tensor_parallel_matches_single_process"],
    "--compile": ["test_common.py::test_compile_compiles_every_block_in_place", "test_common.py::test_compile_compiles_the_loss_too",
                  "test_ddp.py::test_compile_sends_every_block_and_the_loss_through_torch_compile",
                  "test_tensor_parallel.py::test_compiled_tensor_parallel_matches_the_eager_single_process_run"],
    "--float8": ["test_float8.py::test_every_block_linear_is_converted_and_the_head_is_not", "test_float8.py::test_two_ranks_train_the_single_process_float8_run",
                 "test_float8.py::test_fsdp_gathers_float8_weights_and_a_float8_checkpoint_resumes_exactly_and_into_bf16",
                 "test_float8.py::test_tensor_parallel_gathers_activations_in_float8", "test_float8.py::test_context_parallel_gathers_float8_weights",
                 "test_float8.py::test_tensor_parallel_under_fsdp_gathers_float8_weights_over_dp", "test_float8.py::test_pipelined_stages_convert_what_they_hold"],
    "--device": ["test_common.py::test_device_cuda_without_a_gpu_is_refused_before_any_process_group"],
    "--timeout": ["test_errors.py::test_every_rank_stalled_ends_the_job_within_the_timeout_in_one_line", "test_errors.py::test_a_silent_peer_fails_the_job_within_the_timeout"],
    "--log-every": ["test_options.py::test_profile_and_tensorboard_write_their_files"],
    "--timing-warmup-steps": ["test_metrics.py::test_throughput_leaves_out_warmup_and_the_counted_step"],
    "--profile": ["test_options.py::test_profile_and_tensorboard_write_their_files", "test_metrics.py::test_throughput_leaves_out_warmup_and_the_counted_step"],
    "--tensorboard": ["test_options.py::test_profile_and_tensorboard_write_their_files"],
    "--results": ["test_ddp.py::test_results_line_has_every_field"],
    "--checkpoint-dir": ["test_checkpoint.py::test_resume_continues_the_same_run"],
    "--simulate": ["test_simulate.py::test_a_simulated_rank_counts_the_bytes_a_real_one_sends",
                   "test_simulate.py::test_a_simulated_fsdp_rank_holds_one_nth_of_the_training_state"],
    "--count-comm": ["test_simulate.py::test_a_simulated_rank_counts_the_bytes_a_real_one_sends", "test_ddp.py::test_results_line_has_every_field"],
    "--simulate-rank": ["test_simulate.py::test_a_simulated_pipeline_rank_runs_its_own_part_of_the_schedule",
                        "test_simulate.py::test_a_simulated_fsdp_rank_holds_one_nth_of_the_training_state"],
    "--checkpoint-every": ["test_checkpoint.py::test_the_last_step_is_saved_and_an_unreadable_newest_checkpoint_is_set_aside"],
    # ddp_train.py
    "--comm-hook": ["test_ddp.py::test_comm_hook_is_close_but_not_exact", "test_simulate.py::test_a_simulated_rank_counts_the_bytes_a_real_one_sends"],
    "--powersgd-start-iter": ["test_ddp.py::test_comm_hook_is_close_but_not_exact", "test_boundaries.py::test_powersgd_must_start_before_the_last_step"],
    # fsdp_train.py
    "--reshard-after-forward": ["test_fsdp.py::test_fsdp_matches_single_process"],
    "--no-reshard-after-forward": ["test_fsdp.py::test_fsdp_matches_single_process"],
    "--cpu-offload": ["test_fsdp.py::test_fsdp_matches_single_process"],
    # pipeline_train.py and hybrid_train.py
    "--schedule": ["test_pipeline.py::test_schedule_matches_single_process", "test_hybrid.py::test_hybrid_matches_single_process",
                   "test_simulate.py::test_a_simulated_rank_counts_the_bytes_a_real_one_sends"],
    "--micro-batches": ["test_pipeline.py::test_schedule_matches_single_process", "test_run_all.py"],
    "--stages-per-rank": ["test_pipeline.py::test_schedule_matches_single_process"],
    "--split": ["test_pipeline.py::test_schedule_matches_single_process", "test_model_parallel.py::test_model_parallel_matches_single_process"],
    "--pp": ["test_hybrid.py::test_hybrid_matches_single_process"],
    "--dp-wrapper": ["test_hybrid.py::test_hybrid_matches_single_process"],
    "--mesh-order": ["test_hybrid.py::test_hybrid_matches_single_process"],
    # tensor_parallel_train.py
    "--dp": ["test_tensor_parallel.py::test_tensor_parallel_matches_single_process"],
    "--sequence-parallel": ["test_tensor_parallel.py::test_tensor_parallel_matches_single_process"],
    # context_parallel_train.py
    "--cp": ["test_context_parallel.py::test_context_parallel_matches_single_process", "test_context_parallel.py::test_a_simulated_rank_sends_what_a_real_one_sends"],
    # torch's context_parallel has no CPU kernel: here only its refusal shows (the GPU check is in BENCHMARKS.md)
    "--cp-impl": ["test_context_parallel.py::test_what_cannot_split_is_refused_in_one_line"],
}


class _Parser(Exception):
    pass


def parser_of(script, monkeypatch):
    """The script's own command-line parser, taken from its main() before anything runs."""
    module = importlib.import_module(script.removesuffix(".py"))

    def grab(parser):
        raise _Parser(parser)

    monkeypatch.setattr(common, "parse_args", grab)
    with pytest.raises(_Parser) as caught:
        module.main()
    return caught.value.args[0]


def test_every_option_of_every_script_has_a_test_of_its_effect(monkeypatch):
    tests = Path(__file__).parent
    missing, dangling = [], []
    for script in SCRIPTS:
        for action in parser_of(script, monkeypatch)._actions:
            for option in action.option_strings:
                if option.startswith("--") and option not in EFFECTS:
                    missing.append(f"{script} {option}")
    for option, where in EFFECTS.items():
        for test in [] if isinstance(where, str) else where:
            file, _, name = test.partition("::")
            path = tests / file
            defined = {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)} if path.exists() else set()
            if not path.exists() or (name and name not in defined):
                dangling.append(f"{option}: {test}")
        assert isinstance(where, list) or where.startswith(REPORTING_ONLY), f"{option}: {where}"
    assert not missing, f"options with no test of their effect (add one, and its name to EFFECTS): {missing}"
    assert not dangling, f"EFFECTS names tests that do not exist: {dangling}"


def test_model_options_shape_the_model(monkeypatch):
    parser = parser_of("ddp_train.py", monkeypatch)
    monkeypatch.undo()
    for argv, (model, vocab, seq_len) in [
        ([], ("tiny", 512, 64)),
        (["--model", "350m"], ("350m", 32000, 1024)),
        (["--model", "350m", "--vocab-size", "50304", "--seq-len", "256"], ("350m", 50304, 256)),
    ]:
        monkeypatch.setattr(sys, "argv", ["ddp_train.py", *argv])
        args, cfg = common.parse_args(parser)
        assert (cfg.d_model, cfg.n_layers) == (common.PRESETS[model].d_model, common.PRESETS[model].n_layers)
        assert (cfg.vocab_size, args.seq_len, args.lr) == (vocab, seq_len, common.PRESETS[model].lr)


def test_profile_and_tensorboard_write_their_files(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    proc, (record,) = run_script("ddp_train.py", 1, ["--steps", "7", "--profile", tmp_path / "prof", "--log-every", "4",
                                                     "--tensorboard", tmp_path / "tb"], torchrun=False, forked=True)
    trace = json.loads((tmp_path / "prof" / "trace_rank0.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"]), "no matmuls in the trace"
    table = (tmp_path / "prof" / "ops_rank0.txt").read_text()
    assert "Self CPU" in table and table.strip() in proc.stdout, "no op table, or not the one printed"
    # TensorBoard: every step's scalars, whatever --log-every says; no MFU without a known peak (CPU).
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "grad_norm", "lr", "step_seconds", "tokens_per_sec", "peak_mem_gib"}
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert [step for step, _ in scalars["loss"]] == list(range(1, 8)) and all(len(v) == 7 for v in scalars.values())
    assert [v for _, v in scalars["loss"]] == pytest.approx(record["losses"], rel=1e-6)
    assert [v for _, v in scalars["grad_norm"]] == pytest.approx(record["grad_norms"], rel=1e-6)
    # The steps the profiler slowed (its warm-up and 3 traced, then its trace's export in step 6) are not timed: step 7 is.
    assert record["step_seconds"] == pytest.approx(scalars["step_seconds"][-1][1], rel=1e-6)
    assert [v for _, v in scalars["tokens_per_sec"]] == pytest.approx([record["tokens_per_sec"] * record["step_seconds"] / s
                                                                       for _, s in scalars["step_seconds"]], rel=1e-5)
    # --log-every 4: the step line of step 4 and of the last step, no other.
    assert [line.split("|")[0].split()[1] for line in proc.stdout.splitlines() if line.startswith("step ")] == ["4/7", "7/7"]


def test_a_profile_output_that_is_not_a_regular_file_is_refused_before_training(tmp_path):
    # Rank 1's op table would be opened for writing: a FIFO waits for a reader forever (its
    # step watchdog, 5 s here, would end that run: a refusal it is not).
    (tmp_path / "prof").mkdir()
    os.mkfifo(tmp_path / "prof" / "ops_rank1.txt")
    proc, records = run_script("ddp_train.py", 2, ["--steps", "5", "--profile", tmp_path / "prof", "--timeout", "5"], forked=True, timeout=60)
    assert proc.returncode == 2 and records == [] and "step " not in proc.stdout, proc.stderr[-2000:]
    assert proc.stderr.strip() == f"error: --profile: {tmp_path / 'prof' / 'ops_rank1.txt'} is not a regular file", proc.stderr[-2000:]


def _gpu_options():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_options

    return gpu_options


def test_the_gpu_matrix_runs_every_option_of_every_script_or_says_why_not(monkeypatch):
    """benchmarks/gpu_options.py is the GPU's check of the options: a script's new option
    must become one of its cases, or say why one GPU has nothing to show of it."""
    gpu_options = _gpu_options()
    accounted = set(gpu_options.NOT_HERE) | set(gpu_options.ALWAYS)
    unrun = []
    for strategy, script in gpu_options.SCRIPTS.items():
        named = {o for _, options in gpu_options.cases([strategy]) for o in options if o.startswith("--")}
        for action in parser_of(script, monkeypatch)._actions:
            unrun += [f"{script} {o}" for o in action.option_strings if o.startswith("--") and o not in named | accounted]
    assert sorted(gpu_options.SCRIPTS.values()) == sorted(SCRIPTS)
    assert not unrun, f"options the GPU matrix neither runs nor explains: {unrun}"


def test_the_gpu_matrix_checkpoint_case_passes_a_run_stopped_by_sigterm_and_its_resume(tmp_path, monkeypatch):
    """The matrix's own check on the CPU: SIGTERM after step 3 saves and exits 0 (a run cut
    short, not a failure), and the resume goes on as the uninterrupted run."""
    gpu_options = _gpu_options()
    # 8 steps, not the GPU's 100: the signal still lands before the end (after step 3,
    # it stops at 4 or 5), and the CPU trains each step of the three runs in ~0.1 s.
    monkeypatch.setattr(gpu_options, "CHECKPOINT_STEPS", 8)
    args = argparse.Namespace(out=str(tmp_path), model="tiny", data=None)
    (tmp_path / "logs").mkdir()
    rows = gpu_options.checkpoint_case("ddp", args)
    assert [row[2] for row in rows] == ["pass"] * 3, rows


def test_the_gpu_matrix_starts_from_an_empty_out_folder(tmp_path):
    """A second matrix into the same --out: the first one's checkpoints must not make its
    cases resume with nothing to train, nor its outcomes run on into the new ones."""
    gpu_options = _gpu_options()
    stale = tmp_path / "cases" / "ddp---checkpoint-every-3" / "checkpoints" / "step_00000008"
    stale.mkdir(parents=True)
    (tmp_path / "outcomes.jsonl").write_text('["ddp", "(defaults)", "pass", 1.0]\n')
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "old.log").write_text("old")
    gpu_options.fresh_out(str(tmp_path))
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["logs"]
