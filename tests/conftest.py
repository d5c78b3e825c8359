"""Test tiers. `python -m pytest -q -m "not slow"` is the edit-test loop (under 3 minutes on an idle 2-core box);
`python -m pytest -q` (CI and the README) runs everything.

Both run on two pytest-xdist workers (`pytest_cmdline_main` below: a single-process test leaves the second core
idle otherwise). `-n 0` or `-p no:xdist` runs serially in this process (for --pdb, print debugging, a single
test); `-n N` picks another count. Under xdist the known-long tests go first (LONG, then the slow tier), and an
idle worker steals the other's queued tests (`--dist worksteal`), so no long test starts last and straggles.
(`--dist loadgroup` would keep a module fixture's tests on one worker, but xdist 3.8 names groups through
`item._nodeid`, which pytest 9.2 no longer reads: its groups are ignored.)

A test is slow when it forks ranks or starts subprocesses: parity checks over layouts, verify runs, whole
`shardwise train` runs, crash and resume. A file of them says so here (SLOW_FILES) or with a module-level
`pytestmark = pytest.mark.slow`; a slow test in an otherwise fast file is named in SLOW_TESTS (every
parametrisation of it). tests/test_tiers.py checks that every name here still exists."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# The test process builds single-device references and forks ranks: one intra-op thread, as every rank has
# (launch.py sets it). The tiny shapes here gain nothing from a second thread, and on a shared 2-core machine its
# OpenMP spin-waiting made a single-device step 20-250x slower (0.15 s against 11-38 s under load).
torch.set_num_threads(1)

SLOW_FILES = {
    "test_bf16_activations.py", "test_checkpoint.py", "test_comm.py", "test_comm_ops.py", "test_composition.py",
    "test_faults.py", "test_hsdp.py", "test_pipeline.py", "test_planner_ledger.py", "test_random.py",
    "test_recompute_planner.py", "test_resume.py", "test_strict_p2p.py", "test_tensor_parallel.py", "test_verify.py",
    "test_zero.py", "test_moe_training.py", "test_peak_sweep.py", "test_autocast_cache.py", "test_checkpoint_io.py",
    "test_simulate.py", "test_simulate_fast.py",
}

SLOW_TESTS = {
    "test_planner_new_families.py": {"test_hybrid_within_bounds", "test_hybrid_cp_comm_equals_the_ledger",
                                     "test_full_size_layout_within_bounds",
                                     "test_windowed_ring_comm_equals_the_ledger"},
    "test_planner_gpt_oss.py": {"test_gpt_oss_120b_full_size_within_bounds"},
    "test_planner_casts.py": {"test_casts_equal_the_runtimes"},
    "test_gpt_oss.py": {"test_layouts_match_transformers", "test_cp4_sinks_windows_and_documents_match_one_device",
                        "test_verify_every_axis"},
    "test_cli_mistakes.py": {"test_init_from_hf_mtp_and_tokenizer_mistakes"},
    "test_tp_overlap.py": {"test_overlap_ledger_bytes_equal_and_loss_bitwise", "test_verify_overlap_tp2_tp4_and_fused_projections",
                           "test_planner_predicts_the_overlapped_ledger", "test_fused_storage_and_checkpoints_interchange"},
    "test_muon.py": {"test_verify_muon_two_ranks", "test_broken_muon_fails_verify", "test_verify_muon_qk_clip_two_ranks",
                     "test_checkpoint_resumes_bitwise_reshards_and_refuses_adamw", "test_planner_counts_muon_ledger_and_state",
                     "test_simulate_bounds_hold_for_muon"},
    "test_qk_clip_windows.py": {"test_layouts_clip_as_one_device_and_planner_counts_it"},
    "test_run_logs.py": {"test_log_lines_in_a_log_file", "test_resume_with_damaged_checkpoints"},
    "test_async_save.py": {"test_async_save_equals_sync_and_resumes_bitwise",
                           "test_crash_while_async_save_pending_keeps_previous_latest"},
    "test_cli.py": {"test_bad_input_from_the_shell_exits_2_before_any_rank", "test_train_writes_run_directory",
                    "test_verify_prints_json_last_line"},
    "test_compile.py": {"test_verify_compile_tp2_pp2_cp2_in_one_fork"},
    "test_config_report.py": {"test_report_renders_pngs"},
    "test_qwen3_next.py": {"test_layouts_match_single_device_and_transformers"},
    "test_qwen35_checkpoints.py": {"test_multimodal_layouts_match_transformers"},
    "test_context_parallel.py": {"test_ring_and_ulysses_match_sdpa"},
    "test_document_mask.py": {"test_bad_attention_mask_exits_2_with_one_line",
                              "test_verify_every_axis_with_document_mask"},
    "test_evaluate.py": {"test_eval_loss_equal_across_layouts",
                         "test_train_logs_eval_to_metrics_tensorboard_and_report"},
    "test_expert_parallel.py": {"test_expert_parallel_parity_ep2_ep4"},
    "test_generate.py": {"test_greedy_equals_transformers_generate",
                         "test_sampling_is_seeded_and_a_tiny_nucleus_is_greedy", "test_cli_json_last_line",
                         "test_checkpoint_on_prepared_data_uses_its_tokenizer_and_eos"},
    "test_gpu_check.py": {"test_gpu_check_dry_run"},
    "test_hf.py": {"test_training_step_matches_transformers", "test_layout_matches_transformers",
                   "test_finetune_dp2_tp2_zero1_exported_loss_matches_transformers"},
    "test_host_syncs.py": {"test_host_syncs_per_step_within_budget"},
    "test_kernel_choice.py": {"test_summary_records_the_kernel_per_call_site"},
    "test_launch_cluster.py": {"test_launcher_names_the_rank_and_op_where_ranks_stopped",
                               "test_run_local_refuses_to_fork_after_cuda_init"},
    "test_mesh.py": {"test_groups_tp_innermost", "test_one_group_call_per_axis_and_none_for_size_one"},
    "test_mla.py": {"test_summary_states_mla_padding_under_cp"},
    "test_model_families.py": {"test_qwen3_two_rank_layouts", "test_deepseek_layouts",
                               "test_qwen3_four_rank_compositions"},
    "test_mtp.py": {"test_verify_two_rank_layouts", "test_verify_four_rank_compositions",
                    "test_hf_export_loads_in_transformers_and_round_trips", "test_planner_counts_mtp_exactly",
                    "test_planner_zero3_mtp_held_equals_the_traced_gathers",
                    "test_interleaved_zero3_bf16_head_stage_within_bounds"},
    "test_observe.py": {"test_profile_traces_throughput_and_wandb_on_two_ranks",
                        "test_mlflow_dispatch_local_file_store"},
    "test_p2p_nccl.py": {"test_strict_mode_returns_one_work_per_batch", "test_every_schedule_under_strict_p2p"},
    "test_plan_commands.py": {"test_config_and_planner_import_no_torch", "test_commands_spell_out_the_row",
                              "test_top_plan_rows_run_as_printed"},
    "test_plan_trace.py": {"test_trace_two_rows_equals_simulate"},
    "test_prepare_data.py": {"test_sft_loss_counts_only_completions_on_every_layout",
                             "test_train_on_prepared_bpe_data_and_resume"},
    "test_recompute.py": {"test_recompute_equals_no_recompute"},
    "test_run_dir.py": {"test_ctrl_c_stops_every_rank_with_one_line", "test_resume_and_run_directory_contract",
                        "test_resume_without_checkpoint_and_auto_resume"},
    "test_tied_embeddings.py": {"test_tied_verify_norm_ledger_and_equal_copies",
                                "test_tied_checkpoint_stored_once_and_resharded"},
}


# The longest single tests (60 s or more on the 2-core CI box, or 45 s or more in a serial fast tier on the shared
# development box): under xdist they start first. tests/test_tiers.py checks that every name still exists.
LONG = {
    "test_planner_fp8.py": {"test_simulate_deepseek_v3_fp8", "test_simulate_llama3_70b_fp8"},
    "test_planner_gpt_oss.py": {"test_gpt_oss_120b_full_size_within_bounds"},
    "test_moe_skew.py": {"test_train_records_routing_and_plan_reads_it"},
    "test_model_families.py": {"test_deepseek_v3_real_config_yarn"},
    "test_planner.py": {"test_done_when_command", "test_tp_stays_in_nvlink_domain_unless_allowed"},
    "test_rules_once.py": {"test_a_planted_copy_is_found"},
    "test_p2p_program.py": {"test_long_interleaved_program_builds_in_linear_time"},
    "test_structure.py": {"test_the_checks_catch_what_they_guard"},
}


_SIMULATIONS: dict = {}


@pytest.fixture
def shared_simulations(monkeypatch):
    """`simulate.world.simulate_rank` remembered for the session: a rank of a config (equal repr, equal arguments) that
    one test simulated is not simulated again by another (a full-size rank costs 10-20 CPU-s). For tests that change
    nothing the simulated runtime runs; a patched planner is fine (it is not part of the simulation)."""
    import copy
    import inspect

    from shardwise.simulate import world

    real = world.simulate_rank
    signature = inspect.signature(real)

    def remembered(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        key = tuple((k, repr(v)) for k, v in bound.arguments.items())
        if key not in _SIMULATIONS:
            _SIMULATIONS[key] = real(*args, **kwargs)
        return copy.deepcopy(_SIMULATIONS[key])

    monkeypatch.setattr(world, "simulate_rank", remembered)


@pytest.fixture(scope="session")
def uninterrupted_losses(tmp_path_factory) -> list[float]:
    """The losses of test_preemption's whole run (COMMON, END steps) by the built-in launcher: what the preempted and
    resumed runs of test_preemption and test_practice_iii must equal bit for bit. One run per session serves both,
    on whichever xdist worker asks first (the other waits for it: the run is kept in the session's shared temp
    directory, under a lock)."""
    import fcntl
    import json
    import subprocess

    from test_preemption import COMMON, END, _rows

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # every worker's basetemp lies in the run's one directory
    with open(shared / "uninterrupted.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "uninterrupted.json"
        if done.exists():
            return json.loads(done.read_text())
        full = tmp_path_factory.mktemp("uninterrupted")
        tests = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]))
        r = subprocess.run([sys.executable, "-m", "shardwise", *COMMON, "--steps", str(END), "--out", str(full)],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr
        losses = [row["loss"] for row in _rows(full)]
        done.write_text(json.dumps(losses))
        return losses


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """Two xdist workers by default, work-stealing (set in the controller before xdist reads its options): `-n N`
    (0: serial) or `-p no:xdist` overrides it; --pdb, --trace and --collect-only run serially."""
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or any(config.getoption(o, False) for o in ("usepdb", "trace", "collectonly"))):
        return
    if config.option.numprocesses is None:
        config.option.numprocesses = 2
    if config.option.dist == "no":
        config.option.dist = "worksteal"


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = os.path.basename(str(item.path))
        if name in SLOW_FILES or getattr(item, "originalname", item.name) in SLOW_TESTS.get(name, ()):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a serial run keeps the files' order
        # whole files move (a module-scoped fixture is set up once): those with a LONG test, then those with slow ones
        first: dict = {}
        for item in items:
            name = os.path.basename(str(item.path))
            long_, slow = first.get(name, (False, False))
            first[name] = (long_ or getattr(item, "originalname", item.name) in LONG.get(name, ()),
                           slow or item.get_closest_marker("slow") is not None)
        items.sort(key=lambda item: tuple(not x for x in first[os.path.basename(str(item.path))]))
