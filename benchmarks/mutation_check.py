"""Break one feature at a time and see which tests catch it.

Each mutation is a one-place edit of rrfp/ (or torchtitan_ext/) that removes a feature the
README claims. For each, the tree is copied to a temporary folder, the edit applied there,
and the tests that should defend the feature are run against the copy (PYTHONPATH pointing
at it). A mutation no test catches is a claim no test defends. Not part of the default
pytest run (it runs pytest itself, once per mutation).

    python -m benchmarks.mutation_check                   # all mutations
    python -m benchmarks.mutation_check --only hint_as_hint+2 rings_at_microbatch_count
    python -m benchmarks.mutation_check --baseline        # also run each selection unmutated
    python -m benchmarks.mutation_check -o benchmarks/results/mutations.md
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutation:
    name: str
    feature: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    """pytest node ids (or ``file::test`` with ``-k`` expressions after ``|``)."""


MUTATIONS = [
    Mutation(
        "hint_as_hint+2", "buffer_limit='hint' holds no more than the hint, per stage and rank",
        "rrfp/runtime/limit_plan.py",
        "first_step_limits(self.setting, hint,",
        "first_step_limits(\"hint+2\" if self.setting.spec == \"hint\" else self.setting, hint,",
        ("tests/test_memory_limits.py::test_measured_activation_bytes_stay_within_what_the_limit_"
         "allows",)),
    Mutation(
        "rings_at_microbatch_count", "receive buffers grow with the limit, not the microbatches",
        "rrfp/comm/receives.py",
        "size = limits[edge.dst] + 1 if edge.is_forward else limits[edge.dst]",
        "size = len(order)",
        ("tests/test_memory_limits.py::test_receive_buffers_grow_with_the_limit_not_the_"
         "microbatch_count",)),
    Mutation(
        "launch_depth_check_removed", "the rank decides when fewer than launch_depth actions "
        "are incomplete", "rrfp/core/loop.py",
        "free = not arbiter.finished and device.outstanding < self.launch_depth",
        "free = not arbiter.finished",
        ("tests/test_device.py",
         "tests/test_arbiter.py::test_no_deadlock_and_memory_bound_under_random_timings",
         "tests/test_runtime.py::test_bitwise_equal_to_torch_schedule_with_and_without_delays"
         "|1F1B-vs-1F1B or BFW-vs-ZBV")),
    Mutation(
        "policy_is_fixed_order", "readiness-first reorders, and stays bitwise the fixed schedule",
        "rrfp/runtime/pipeline.py",
        "make_policy(self.limits.policy, history=self.history, clock=clock)",
        "make_policy(\"fixed\", history=self.history, clock=clock)",
        ("tests/test_runtime.py::test_bitwise_equal_to_torch_schedule_with_and_without_delays",
         "tests/test_runtime.py::test_outputs_and_eval_match_torch",
         "tests/test_composability.py::test_compiled_stages_match_the_uncompiled_fixed_schedule_"
         "without_recompiling",
         "tests/test_composability.py::test_pipeline_x_tensor_parallel_coordinates_the_tp_ranks"
         "|leader and Interleaved1F1B",
         "tests/test_variable_shapes.py::test_microbatches_of_different_shapes")),
    Mutation(
        "arbiter_held_off_by_one", "the simulator keeps every rank within its memory limit "
        "(the arbiter's rank count one low)", "rrfp/core/arbiter.py",
        "        self.held = 0\n", "        self.held = -1\n",
        ("tests/test_arbiter.py::test_no_deadlock_and_memory_bound_under_random_timings",)),
    Mutation(
        "arbiter_stage_held_off_by_one", "the simulator keeps every stage within its memory "
        "limit (the arbiter's stage counts one low)", "rrfp/core/arbiter.py",
        "self.in_flight = {s: 0 for s in local}", "self.in_flight = {s: -1 for s in local}",
        ("tests/test_arbiter.py::test_no_deadlock_and_memory_bound_under_random_timings",)),
    Mutation(
        "sim_reports_held_off_by_one", "the simulator reports the peaks held",
        "rrfp/sim/engine.py",
        "rank_peaks={r: loop.arbiter.peak_held for r, loop in loops.items()},",
        "rank_peaks={r: loop.arbiter.peak_held - 1 for r, loop in loops.items()},",
        ("tests/test_arbiter.py::test_no_deadlock_and_memory_bound_under_random_timings",)),
    Mutation(
        "header_of_88_bytes", "a variable-shape header is 80 bytes for one tensor",
        "rrfp/comm/receives.py", "HEADER_DIMS = 8\n", "HEADER_DIMS = 9\n",
        ("tests/test_variable_shapes.py::test_fixed_shapes_send_no_header_and_variable_shapes_"
         "one_per_activation",)),
    Mutation(
        "bytes_sent_counts_elements", "the stats count the bytes sent",
        "rrfp/comm/transport.py", "self._bytes_sent += sum(t.nbytes for t in tensors)",
        "self._bytes_sent += sum(t.numel() for t in tensors)",
        ("tests/test_variable_shapes.py::test_fixed_shapes_send_no_header_and_variable_shapes_"
         "one_per_activation",)),
    Mutation(
        "ddp_one_bucket", "DDP gradients are reduced in buckets of at most bucket_bytes_cap",
        "rrfp/runtime/data_parallel.py",
        "for bucket in gradient_buckets([p.grad for p in params], module.bucket_bytes_cap):",
        "for bucket in [[p.grad for p in params]]:",
        ("tests/test_composability.py::test_ddp_reduces_in_buckets_no_larger_than_its_bucket_cap",
         "tests/test_composability.py::test_ddp_gradients_are_reduced_in_buckets_of_at_most_the_cap")),
    Mutation(
        "fsdp_reshards_after_forward", "FSDP modules stay unsharded for the whole step",
        "rrfp/runtime/data_parallel.py", "module.set_reshard_after_forward(False, recurse=False)",
        "module.set_reshard_after_forward(True, recurse=False)",
        ("tests/test_composability.py::test_fsdp_unshards_for_the_whole_step_and_reduce_scatters_"
         "at_reduce_grad_in_stage_order",)),
    Mutation(
        "fsdp_no_unshard_at_step_start", "FSDP modules are unsharded at step start, in stage "
        "order", "rrfp/runtime/data_parallel.py",
        "handles = [module.unshard(async_op=True) for module in fsdp_modules]",
        "handles = []",
        ("tests/test_composability.py::test_fsdp_unshards_for_the_whole_step_and_reduce_scatters_"
         "at_reduce_grad_in_stage_order",)),
    Mutation(
        "abort_while_the_peer_sends", "a failed rank aborts its gloo channels only once the "
        "peers of its channels said they stopped sending",
        "rrfp/comm/transport.py", "        if failed:\n            self._stop_sending()\n",
        "",
        ("tests/test_step_failures.py::test_no_rank_breaks_a_gloo_channel_its_peer_still_"
         "sends_on",)),
    Mutation(
        "a_wait_span_per_poll", "the step loop records one wait span per idle stretch, not one "
        "per poll of a polled source",
        "rrfp/core/loop.py", "            extends_wait = True\n", "",
        ("tests/test_device.py::test_a_polled_loop_records_one_wait_per_idle_stretch_not_one_"
         "per_poll",)),
    Mutation(
        "gloo_send_kept", "a sent tensor is let go once its send completes (gloo and NCCL)",
        "rrfp/comm/transport.py", "        data = [t.detach() for t in tensors]\n",
        "        data = [t.detach() for t in tensors]\n"
        "        self.__dict__.setdefault(\"kept\", []).extend(data)\n",
        ("tests/test_memory.py",)),
    Mutation(
        "dtensor_variable_shapes_accepted", "variable_shapes refuses DTensor activations",
        "rrfp/comm/receives.py",
        "if isinstance(getattr(info, \"tensor_meta\", None), _DTensorMeta):",
        "if False:",
        ("tests/test_composability.py::test_variable_shapes_refuse_dtensor_activations",)),
    Mutation(
        "torchtitan_grads_scaled_slightly", "RRFP in torchtitan logs the fixed schedule's "
        "losses (a gradient off by one part in 10^7)", "rrfp/runtime/schedule.py",
        "self._n_microbatches if self.scale_grads else 1)",
        "self._n_microbatches if self.scale_grads else 1.0000001)",
        ("tests/test_titan_training.py::test_rrfp_trains_exactly_as_the_fixed_schedule"
         "|pp-1f1b",)),
    Mutation(
        "advise_limits_ignored", "the advisor predicts each setting at its own limits",
        "rrfp/advise/predict.py",
        "return resolve_buffer_limits(limit, hint, fixed_order=setting.policy == \"fixed\")",
        "return resolve_buffer_limits(\"hint\", hint, fixed_order=setting.policy == \"fixed\")",
        ("tests/test_advise.py::test_the_run_is_replayed_exactly_and_each_setting_predicted",)),
    Mutation(
        "trace_without_step_metadata", "traces carry what the advisor needs of each step",
        "rrfp/core/stats.py", "{\"ph\": \"M\", \"name\": STEP_METADATA,",
        "{\"ph\": \"M\", \"name\": \"step\",",
        ("tests/test_advise.py::test_the_run_is_replayed_exactly_and_each_setting_predicted",)),
    Mutation(
        "verdict_without_the_peak_keeping_setting", "the verdict names the best setting that "
        "keeps the job's peak", "rrfp/advise/report.py",
        "flat = self.best(None if peak is None else 0)", "flat = self.best(None)",
        ("tests/test_advise.py::test_the_verdict_names_the_best_within_the_margin_and_the_best_"
         "keeping_the_peak",)),
    Mutation(
        "too_few_steps_unsaid", "the advisor says when the measured steps are too few",
        "rrfp/advise/report.py", "MIN_STEPS = 3", "MIN_STEPS = 2",
        ("tests/test_advise.py::test_too_few_steps_are_said",)),
    Mutation(
        "advice_errors_as_tracebacks", "a run the advisor cannot use is said in one line",
        "rrfp/advise/__main__.py", "    except AdviceError as e:",
        "    except KeyboardInterrupt as e:",
        ("tests/test_advise.py::test_a_run_it_cannot_use_is_said_in_one_line",
         "tests/test_advise.py::test_a_bad_run_stops_the_command_without_a_traceback")),
    Mutation(
        "advice_mixes_jobs", "traces of another hint or microbatch count are refused",
        "rrfp/advise/measured.py",
        "SHAPE = (\"hint\", \"placement\", \"num_stages\", \"n_microbatches\", \"buffer_limit\")",
        "SHAPE = (\"placement\",)",
        ("tests/test_advise.py::test_a_run_it_cannot_use_is_said_in_one_line|hint or microbatches",)),
    Mutation(
        "advice_rows_option_ignored", "python -m rrfp.advise shows the best --rows settings",
        "rrfp/advise/__main__.py", "advice.table(args.rows or None)", "advice.table()",
        ("tests/test_advise.py::test_the_command_prints_the_table_and_the_verdict_and_draws_the_"
         "charts",)),
    Mutation(
        "ab_pairs_one_sided", "the A/B compares a fixed step with the RRFP steps on both sides",
        "rrfp/core/ab_pairs.py", "for j in (i - 1, i + 1)", "for j in (i - 1,)",
        ("tests/test_advise.py::test_the_ab_pairs_each_fixed_step_with_its_neighbours",
         "tests/test_ab_pairs.py::test_the_a_b_pairs_each_fixed_step_with_its_neighbours")),
    Mutation(
        "fixed_every_ignored", "the in-run A/B runs every k-th step in the fixed order",
        "rrfp/runtime/pipeline.py", "fixed = training and (self.fixed_every > 0 and (",
        "fixed = training and (False and (",
        ("tests/test_advise.py::test_in_run_ab_measures_what_the_advisor_predicts_and_stays_"
         "bitwise",
         "tests/test_titan_training.py::test_rrfp_trains_exactly_as_the_fixed_schedule|in-run-ab")),
    Mutation(
        "fixed_steps_bounded_launch", "the A/B's fixed steps launch without bound, as torch's",
        "rrfp/runtime/pipeline.py", "launch_depth=math.inf if fixed else self.launch_depth,",
        "launch_depth=self.launch_depth,",
        ("tests/test_advise.py::test_in_run_ab_measures_what_the_advisor_predicts_and_stays_"
         "bitwise",)),
    Mutation(
        "no_end_of_run_summary", "torchtitan jobs end with the verdict and a summary",
        "torchtitan_ext/common/stats_logging.py", "stats_log.advice.finish()", "pass",
        ("tests/test_titan_logging.py::test_main_job_trains_on_cpu_and_logs_rrfp_stats",)),
    Mutation(
        "critical_ignores_sizes", "critical costs each action by the duration its "
        "microbatch's size predicts, on every stage", "rrfp/core/policy.py",
        "    if history is None or not history.sizes_tell_apart:", "    if True:",
        ("tests/test_sizes.py::test_critical_ranks_by_the_sizes_of_the_step_on_every_stage",
         "tests/test_sizes.py::test_knowing_sizes_gains_where_costs_follow_them")),
    Mutation(
        "size_fits_not_shared", "every rank predicts every stage from the fits the ranks "
        "share (simulator)", "rrfp/sim/engine.py",
        "        _share_fits(learned.values())", "        pass",
        ("tests/test_sizes.py::test_the_simulated_policy_is_told_sizes_and_predicts_from_"
         "earlier_steps_only",)),
    Mutation(
        "packed_sizes_change_decisions", "a step whose sizes are all alike is decided as "
        "without sizes", "rrfp/core/history.py",
        "self._sizes_tell_apart = tell_apart(sizes)",
        "self._sizes_tell_apart = sizes is not None",
        ("tests/test_sizes.py::test_without_sizes_that_tell_microbatches_apart_decisions_are_"
         "as_without_sizes",)),
    Mutation(
        "other_hint_not_ranking", "a self-driving setting of another hint ranks by that hint "
        "(tune_hints)", "rrfp/runtime/pipeline.py",
        "hint = (self.limits.ranked_by or self.hint) if training else self._forward_only",
        "hint = self.hint if training else self._forward_only",
        ("tests/test_self_driving.py::test_with_tune_hints_every_rank_switches_to_an_"
         "interchangeable_hint_and_stays_bitwise",)),
    Mutation(
        "runtime_fits_not_shared", "every rank costs every stage from the fits the ranks "
        "share through the store (runtime)", "rrfp/runtime/pipeline.py",
        "            self.history.models.adopt(self.fit_sharing.latest())", "            pass",
        ("tests/test_sizes_runtime.py::test_sized_steps_share_fits_predict_by_size_and_"
         "keep_torchs_gradients",)),
    Mutation(
        "mb_sizes_length_unchecked", "sizes of the wrong length raise ValueError before the "
        "step communicates", "rrfp/core/sizes.py",
        "    if len(given) != n_microbatches:", "    if False:",
        ("tests/test_sizes_runtime.py::test_bad_sizes_raise_value_error_on_every_rank_before_"
         "any_communication",)),
    Mutation(
        "size_error_relative_to_prediction", "the stats' size prediction error is relative to "
        "the measured duration", "rrfp/core/history.py",
        "append(abs(predicted - seconds) / seconds)",
        "append(abs(predicted - seconds) / predicted)",
        ("tests/test_sizes.py::test_the_prediction_error_is_per_stage_the_median_relative_"
         "error_before_learning",)),
    Mutation(
        "torchtitan_sizes_not_given", "torchtitan's variable-shape jobs give ScheduleRRFP each "
        "microbatch's size", "torchtitan_ext/titan_0_2/trainer_hooks.py",
        "mb_sizes=microbatches.sizes)", "mb_sizes=None)",
        ("tests/test_titan_training.py::test_variable_shape_data_paths_train_and_their_loss_falls"
         "|documents",)),
    Mutation(
        "tuner_never_falls_back", "self-driving falls back when the in-run A/B says its "
        "setting is slower", "rrfp/core/tuning.py",
        "if pairs.upper_bound(look_quantile(rules.confidence, count, rules.min_pairs)) >= 0:",
        "if True:",
        ("tests/test_tuning.py::test_falls_back_when_the_a_b_says_the_setting_is_slower",
         "tests/test_tuning.py::test_falls_back_to_the_hints_own_setting_when_no_candidate_is_left")),
    Mutation(
        "fall_back_bound_per_look", "the fall-back's bound holds over every look at the A/B's "
        "pairs, not at each", "rrfp/core/ab_pairs.py",
        "    return _t_of_normal(z, pairs - 1)", "    return t_quantile(confidence, pairs - 1)",
        ("tests/test_ab_pairs.py::test_the_fall_back_s_bound_holds_over_every_look",)),
    Mutation(
        "drift_reference_unbounded", "the tuner keeps a bounded number of steps for the "
        "drift's reference, whatever the run's length", "rrfp/core/tuning.py",
        "if len(self._earlier) > self._reference:", "if False:",
        ("tests/test_tuning.py::test_the_drift_s_reference_keeps_the_latest_steps_sorted",)),
    Mutation(
        "tuner_ignores_drift", "self-driving measures again when the step times drift",
        "rrfp/core/tuning.py", "since.drifting = since.drifting + 1 if strays else 0",
        "since.drifting = 0",
        ("tests/test_tuning.py::test_a_drift_in_the_step_times_measures_again_and_chooses_anew",)),
    Mutation(
        "self_driving_plan_ignored", "every rank runs the setting the deciding rank chose",
        "rrfp/runtime/self_driving.py",
        "limit, policy, use_sizes, ranked_by, ab_fixed = self._plan.runs[step % block]",
        "limit, policy, use_sizes, ranked_by, ab_fixed = self._plan.runs[step % block]\n"
        "        limit = limit if self.deciding else \"hint\"",
        ("tests/test_self_driving.py::test_every_rank_switches_at_the_same_step_within_a_byte_"
         "budget_and_stays_bitwise",)),
    Mutation(
        "self_driving_keeps_traces", "the store keeps no shared trace once the deciding rank "
        "read it", "rrfp/runtime/self_driving.py",
        "self.board.forget(f\"{TRACE}/{step}\", self._pipeline_ranks, job=True)", "pass",
        ("tests/test_self_driving.py::test_every_rank_switches_at_the_same_step_within_a_byte_"
         "budget_and_stays_bitwise",)),
    Mutation(
        "tuner_unchecked_before_decision", "the in-run A/B checks the hint's own setting while "
        "the first decision waits", "rrfp/core/tuning.py",
        "if self.setting == FIXED_ORDER:",
        "if self.setting == FIXED_ORDER or len(self.decisions) == 1:",
        ("tests/test_tuning.py::test_the_a_b_checks_the_hints_own_setting_while_the_first_"
         "decision_waits",
         "tests/test_tuning.py::test_the_hints_own_setting_found_slower_before_any_prediction_"
         "falls_back")),
    Mutation(
        "tuner_forgets_rejected_on_first_choice", "what the A/B found slower before the first "
        "prediction stays rejected by it", "rrfp/core/tuning.py",
        "        best = self._next_candidate()\n        if best is None:",
        "        if first:\n            self._rejected.clear()\n        best = "
        "self._next_candidate()\n        if best is None:",
        ("tests/test_tuning.py::test_the_hints_own_setting_found_slower_before_any_prediction_"
         "falls_back",)),
    Mutation(
        "self_driving_ignores_cpu_share", "a prediction starts only where it fits the CPU "
        "share predictions may take beside training", "rrfp/advise/cost.py",
        "return self.spent + self.expected(actions, starting=starting) <= self.granted",
        "return True",
        ("tests/test_cost.py::test_a_prediction_waits_until_it_fits_the_share_and_the_hints_"
         "setting_runs_meanwhile",)),
    Mutation(
        "prediction_process_not_kept", "the self-driving predictions after the first reuse "
        "the process the first started (only it imports torch)", "rrfp/advise/tuning.py",
        "if self._child is None:", "if True:",
        ("tests/test_self_driving.py::test_the_prediction_process_predicts_what_the_advisor_"
         "predicts_and_is_kept",)),
    Mutation(
        "a_b_settles_unmeasured", "the in-run A/B verifies rarely only once its pairs "
        "measured the setting faster", "rrfp/core/tuning.py",
        "return pairs.count >= self.rules.settle_pairs and pairs.mean() > 0",
        "return pairs.count >= self.rules.settle_pairs",
        ("tests/test_tuning.py::test_a_setting_measured_slower_keeps_its_a_b_frequent_until_"
         "it_falls_back",)),
    Mutation(
        "fall_back_cascades", "a fall-back runs the plain setting, not the next candidate "
        "of the prediction that over-predicted the rejected one", "rrfp/core/tuning.py",
        'self._decide(self._plain(), "fall back", measured=measured)',
        'self._decide(next((p.setting for p in self._ranked if p.setting not in '
        'self._rejected and p.setting != OWN), self._plain()), "fall back", '
        'measured=measured)',
        ("tests/test_tuning.py::test_a_fall_back_does_not_cascade_through_the_candidates_of_"
         "the_same_prediction",)),
    Mutation(
        "predictions_uncalibrated_after_fall_back", "after a fall-back, predictions count at "
        "the replay's error the A/B measured", "rrfp/core/tuning.py",
        "return min([1.0, *(self._rejected[p.setting] / p.speedup for p in self._ranked",
        "return min([1.0, *(1.0 for p in self._ranked",
        ("tests/test_tuning.py::test_later_predictions_count_at_the_replays_error_measured_by_"
         "a_fall_back",)),
    Mutation(
        "kept_process_budgeted_as_new", "a prediction in the kept process is expected to "
        "take its replay's CPU, not a new process's start-up", "rrfp/runtime/self_driving.py",
        "elif self._budget.allows(run.actions, starting=starting):",
        "elif self._budget.allows(run.actions):",
        ("tests/test_cost.py::test_a_prediction_waits_until_it_fits_the_share_and_the_hints_"
         "setting_runs_meanwhile",)),
]


def target_problems(mutations: list[Mutation] = MUTATIONS, root: str = ROOT) -> list[str]:
    """Why each mutation could not be applied to ``root`` as it stands: its file missing, or
    its text not there exactly once (the code moved on: update the mutation); or why its
    tests could not run: a test file, or a test function, that is not there (the tests
    moved on: update the selection)."""
    problems = []
    for mutation in mutations:
        problems += [f"{mutation.name}: {problem}" for item in mutation.tests
                     if (problem := _selection_problem(root, item))]
        path = os.path.join(root, mutation.path)
        if not os.path.isfile(path):
            problems.append(f"{mutation.name}: {mutation.path} does not exist")
            continue
        with open(path) as f:
            count = f.read().count(mutation.old)
        if count != 1:
            problems.append(f"{mutation.name}: the text to mutate occurs {count} times in "
                            f"{mutation.path} (expected once)")
    return problems


def _selection_problem(root: str, item: str) -> str | None:
    """What is missing for ``item`` (``file``, or ``file::test`` with ``|-k expression``)."""
    path, _, test = item.partition("|")[0].partition("::")
    if not os.path.isfile(os.path.join(root, path)):
        return f"the test file {path} does not exist"
    function = test.split("[")[0]
    with open(os.path.join(root, path)) as f:
        defined = {node.name for node in ast.parse(f.read()).body
                   if isinstance(node, ast.FunctionDef)}
    if function and function not in defined:
        return f"{path} has no test {function}"
    return None


def _copy_tree(dest: str) -> None:
    # The venvs stay behind (several GB; the tests run with this interpreter, the copy
    # first on PYTHONPATH).
    ignore = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", "outputs", ".pytest_cache")
    for name in os.listdir(ROOT):
        if name in (".git", "outputs", ".pytest_cache") or name.startswith(".venv"):
            continue
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(dest, name), ignore=ignore, symlinks=True)
        else:
            shutil.copy2(src, os.path.join(dest, name))


def _apply(tree: str, mutation: Mutation) -> None:
    path = os.path.join(tree, mutation.path)
    with open(path) as f:
        text = f.read()
    count = text.count(mutation.old)
    if count != 1:
        raise SystemExit(f"{mutation.name}: the text to mutate occurs {count} times in "
                         f"{mutation.path} (expected once): update the mutation")
    with open(path, "w") as f:
        f.write(text.replace(mutation.old, mutation.new))


def _pytest(tree: str, selection: tuple[str, ...], timeout: float) -> tuple[list[str], int, str, float]:
    """Run each selection in ``tree``; (failed test ids, passed count, last lines, seconds)."""
    failed: list[str] = []
    passed = 0
    tail = ""
    start = time.perf_counter()
    for item in selection:
        node, _, expression = item.partition("|")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
               "--timeout", "600", node]
        if expression:
            cmd += ["-k", expression]
        env = {**os.environ, "PYTHONPATH": tree}
        try:
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            out = proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or "") if isinstance(e.stdout, str) else ""
            failed.append(f"{node} (timed out after {timeout:.0f} s)")
            continue
        failed += [line.split()[1] for line in out.splitlines() if line.startswith("FAILED ")]
        # A test whose fixture the mutation breaks errors instead of failing: caught too
        # (-rfE lists both in the short summary).
        failed += [f"{line.split()[1]} (error)" for line in out.splitlines()
                   if line.startswith("ERROR ")]
        summary = re.search(r"(\d+) passed", out)
        passed += int(summary.group(1)) if summary else 0
        tail = out.strip().splitlines()[-1] if out.strip() else ""
    return failed, passed, tail, time.perf_counter() - start


def _grouped(test_ids: list[str]) -> str:
    """``file::test`` once per test function, with how many of its cases failed."""
    counts: dict[str, int] = {}
    for test_id in test_ids:
        function = test_id.split("[")[0].replace("tests/", "")
        counts[function] = counts.get(function, 0) + 1
    return ", ".join(f"{f} ({n})" if n > 1 else f for f, n in counts.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.mutation_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help=f"mutations to run (default: all): {[m.name for m in MUTATIONS]}")
    parser.add_argument("--baseline", action="store_true",
                        help="first run each selection on the unmutated tree (it must pass)")
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds per pytest run (default 1200)")
    parser.add_argument("-o", "--output", help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutations {sorted(unknown)}")
    problems = target_problems(chosen)
    if problems:
        # Every target is checked before any runs: a rotten one stops nothing silently.
        raise SystemExit("mutations that no longer fit the code (update them):\n"
                         + "\n".join(problems))
    rows = []
    caught_all = True
    for mutation in chosen:
        with tempfile.TemporaryDirectory(prefix="rrfp-mutation-") as tree:
            _copy_tree(tree)
            if args.baseline:
                failed, _, tail, _ = _pytest(tree, mutation.tests, args.timeout)
                if failed:
                    print(f"{mutation.name}: the unmutated selection fails: {failed} ({tail})")
                    caught_all = False
                    continue
            _apply(tree, mutation)
            failed, passed, tail, seconds = _pytest(tree, mutation.tests, args.timeout)
        caught = bool(failed)
        caught_all &= caught
        row = (mutation.name, mutation.feature, "caught" if caught else "NOT CAUGHT",
               len(failed), passed, _grouped(failed), seconds)
        rows.append(row)
        print(f"{row[0]}: {row[2]} ({row[3]} failed, {row[4]} passed, {seconds:.0f} s): {row[5]}",
              flush=True)
    lines = ["| mutation | feature | result | failed | passed | tests that failed (cases) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| `{r[0]}` | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.output:
        with open(args.output, "w") as f:
            f.write(table + "\n")
    return 0 if caught_all else 1


if __name__ == "__main__":
    sys.exit(main())
