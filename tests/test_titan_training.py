"""torchtitan jobs that train under RRFP: losses and gradient norms bitwise those of
torch's fixed schedule (PP, PP x FSDP, PP x TP, validation), stock ``torchtitan.train``,
and the variable-shape data paths (documents, multimodal), whose microbatches are cut to
their own content."""

from __future__ import annotations

import re

import pytest

from tests.titan_helpers import (
    assert_one_rank_prints, failure_excerpt, four_ranks, GRAD_NORM, logged_losses, LOSS,
    METERED, only_0_3, run_titan, STATS_LINE, tensorboard_scalars, tensorboard_values,
    titan_integration, UNMETERED)


@pytest.mark.parametrize("fixed,nproc,steps,parallelism,rrfp", [
    pytest.param("Interleaved1F1B", 2, 4, [], ["--rrfp.fixed_every", "2"],
                 id="pp-interleaved-with-in-run-ab"),
    pytest.param("1F1B", 2, 4, [], [], id="pp-1f1b"),
    pytest.param("Interleaved1F1B", 4, 3, ["--parallelism.data_parallel_shard_degree", "2"], [],
                 id="pp-x-fsdp", marks=four_ranks),
    pytest.param("Interleaved1F1B", 4, 3, ["--parallelism.tensor_parallel_degree", "2"], [],
                 id="pp-x-tp", marks=four_ranks),
])
def test_rrfp_trains_exactly_as_the_fixed_schedule(fixed, nproc, steps, parallelism, rrfp,
                                                   tmp_path):
    """Losses and gradient norms at every step, bitwise (float32), RRFP against torch's
    fixed schedule of its hint under torchtitan; with the in-run A/B (``rrfp`` options),
    its fixed-order steps too, and its measured ratio beside the advisor's prediction."""
    runs = {}
    for schedule in (fixed, f"RRFP-{fixed}"):
        code, out = run_titan(nproc, "--training.steps", str(steps), *parallelism,
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              *(rrfp if schedule.startswith("RRFP") else []),
                              dump=str(tmp_path / schedule), timeout=400)
        assert code == 0, f"{schedule}: {failure_excerpt(out)}"
        assert sorted(logged_losses(out)) == list(range(1, steps + 1))
        assert (f"ScheduleRRFP with hint {fixed}" in out) == schedule.startswith("RRFP")
        values = tensorboard_values(tmp_path / schedule)
        runs[schedule] = {tag: values[tag] for tag in (LOSS, GRAD_NORM)}
    if "--parallelism.data_parallel_shard_degree" in parallelism:
        # Each replica's line; step 1 is the metered one (meter_every=100).
        assert re.search(STATS_LINE.format(step=1, fixed="", label="dp0/", activations=METERED), out), out[-3000:]
    if rrfp:  # steps 2 and 4 in the fixed order, each against the RRFP steps beside it
        for step in (2, 4):
            assert re.search(STATS_LINE.format(step=step, fixed=" \\(fixed order\\)", label="",
                                               activations=UNMETERED), out), failure_excerpt(out)
        assert re.search(r"rrfp step  \d( \(fixed order\))?: .* \| A/B fixed order / RRFP step time \d\.\d+x, so "
                         r"far \d\.\d\dx \[\d\.\d\d-\d\.\d\d\] over 2 pairs", out), failure_excerpt(out)
        assert re.search(r"  rrfp: timing variability .*; this run \(buffer_limit='hint', policy "
                         r"lookahead\) \d\.\d\dx, measured \d\.\d\dx by the in-run A/B", out)
        assert len(tensorboard_values(tmp_path / schedule)["rrfp/ab_speedup"]) == 2
    assert len(runs[fixed][LOSS]) == steps
    assert runs[fixed] == runs[f"RRFP-{fixed}"]


@only_0_3
def test_validation_under_rrfp_equals_the_fixed_schedules(tmp_path):
    """torchtitan 0.3's validator calls ``pp_schedule.eval(arg_mbs=...)`` (the config
    functions point it at the generated corpus)."""
    runs = {}
    for schedule in ("Interleaved1F1B", "RRFP"):
        code, out = run_titan(2, "--training.steps", "2", "--validator.enable",
                              "--validator.freq", "1", "--validator.steps", "2",
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              dump=str(tmp_path / schedule))
        assert code == 0, failure_excerpt(out)
        values = tensorboard_values(tmp_path / schedule)
        runs[schedule] = values["validation_metrics/loss"] + values[LOSS]
    assert len(runs["RRFP"]) == 4
    assert runs["RRFP"] == runs["Interleaved1F1B"]


@titan_integration
def test_stock_torchtitan_train_runs_rrfp(tmp_path):
    """``torchrun -m torchtitan.train``: with the TOML's ``custom_import`` (0.2.2), with
    ``--module torchtitan_ext`` (0.3). A V placement, whose loss (and TensorBoard) is on
    rank 0; also without the activation meter: the metric shows as not measured."""
    code, out = run_titan(2, "--training.steps", "2",
                          "--parallelism.pipeline_parallel_schedule", "RRFP-ZBVZeroBubble",
                          "--rrfp.trace_folder", "traces", "--rrfp.no-meter-activations",
                          dump=str(tmp_path), module="torchtitan.train")
    assert code == 0, failure_excerpt(out)
    assert_one_rank_prints(out)
    assert "ScheduleRRFP with hint ZBVZeroBubble (v placement)" in out
    # RRFP's line alone (torchtitan 0.3 also logs one for the placement schedule it builds).
    assert out.count("Using pipeline schedule") == 1, failure_excerpt(out)
    assert sorted(logged_losses(out)) == [1, 2]
    assert re.search(STATS_LINE.format(step=2, fixed=r" \(fixed order\)", label="",
                                       activations=UNMETERED), out)
    assert "peak activations: not measured (rrfp.meter_activations off)" in out
    scalars = tensorboard_scalars(tmp_path)
    assert scalars.get("rrfp/dispatch_overhead_us/pp1") == 2
    # TensorBoard is written by the rank with the loss (others have -1).
    assert len(tensorboard_values(tmp_path)[LOSS]) == 2
    assert min(tensorboard_values(tmp_path)[LOSS]) > 0
    assert not any("peak_activation_bytes" in tag for tag in scalars)
    (run_traces,) = (tmp_path / "traces").iterdir()
    assert sorted(p.name for p in run_traces.iterdir()) == ["step1.json", "step2.json"]


@titan_integration
@pytest.mark.parametrize("job", ["documents", "multimodal"])
def test_variable_shape_data_paths_train_and_their_loss_falls(job, tmp_path):
    code, out = run_titan(2, "--training.steps", "6", "--rrfp.meter_every", "1",
                          dump=str(tmp_path), job=job)
    assert code == 0, failure_excerpt(out)
    losses = logged_losses(out)
    assert sorted(losses) == list(range(1, 7))
    assert float(losses[6]) < float(losses[1]) - 2.0
    # Microbatches differ in length, so what a stage holds differs from step to step.
    values = tensorboard_values(tmp_path)
    assert len(set(values["rrfp/peak_activation_bytes/pp0"])) > 1, values
    # Each microbatch's size went to the schedule: from the second step on, every stage's
    # durations were predicted from them, and the error is logged per stage.
    for stage in range(4):
        errors = values[f"rrfp/size_prediction_error/stage{stage}"]
        assert len(errors) == 5 and all(0 <= e < 10 for e in errors), (stage, errors)
    assert re.search(r"rrfp step  6: .* pp0 .* size-predicted ±\d+%", out), failure_excerpt(out)


def test_variable_length_microbatches_train_as_the_fixed_schedule_on_padded_ones(tmp_path):
    """Documents: RRFP on microbatches cut to their own length gives the losses and
    gradient norms of torch's fixed schedule on microbatches padded to ``seq_len``
    (padding comes last and is ignored by the loss, which torchtitan divides by the
    number of valid tokens; causal attention never looks at it)."""
    runs = {}
    for schedule in ("Interleaved1F1B", "RRFP"):
        code, out = run_titan(2, "--training.steps", "3",
                              "--parallelism.pipeline_parallel_schedule", schedule,
                              "--rrfp.meter_every", "1",
                              dump=str(tmp_path / schedule), job="documents")
        assert code == 0, failure_excerpt(out)
        values = tensorboard_values(tmp_path / schedule)
        runs[schedule] = values[LOSS] + values[GRAD_NORM]
    assert len(set(values["rrfp/peak_activation_bytes/pp0"])) > 1, values  # RRFP's run
    assert len(runs["RRFP"]) == 6
    assert runs["RRFP"] == pytest.approx(runs["Interleaved1F1B"], rel=1e-6)


def test_microbatches_are_cut_to_their_own_content():
    import torch
    from torchtitan.components.loss import IGNORE_INDEX

    from torchtitan_ext.common.data import split_by_content

    lengths = [20, 70, 33, 5]
    inputs = torch.zeros(4, 128, dtype=torch.long)
    labels = torch.full((4, 128), IGNORE_INDEX)
    for row, length in enumerate(lengths):
        labels[row, :length] = 1
    counts = torch.tensor([0, 8, 3, 40])
    extra = {"patches": torch.randn(4, 40, 48), "patch_counts": counts}
    mbs = split_by_content(inputs, labels, extra, 2)
    # Microbatch 0 holds rows 0-1: 70 tokens -> 80, 8 patches; microbatch 1: 33 -> 48, 40.
    assert [a[0].shape for a in mbs.args] == [(2, 80), (2, 48)]
    assert [kw["patches"].shape[1] for kw in mbs.kwargs] == [8, 40]
    assert mbs.shapes == [(2, 88), (2, 88)]
    assert (mbs.targets[0][:, :8] == IGNORE_INDEX).all()
    padded = split_by_content(inputs, labels, extra, 2, pad_to=(96, 40))
    assert [a[0].shape for a in padded.args] == [(2, 96), (2, 96)]
    assert padded.shapes == [(2, 136), (2, 136)]
    with pytest.raises(ValueError, match=r"needs at least \(80, 40\)"):
        split_by_content(inputs, labels, extra, 2, pad_to=(64, 40))
