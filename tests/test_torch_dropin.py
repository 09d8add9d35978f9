"""Code written for torch's schedules runs on ScheduleRRFP: hints loaded after
construction, custom functions, torch's runtime interface, and a schedule that stays
usable after an error raised before any communication (torch's own tests, adapted, are in
tests/torch_adapted/)."""

from __future__ import annotations

from rrfp.local import run_local_world
from tests import dropin_workers


def test_a_csv_loaded_after_construction_becomes_the_hint(tmp_path):
    ranks = run_local_world(2, dropin_workers.loaded_hints, str(tmp_path), timeout=180)
    for rank, result in enumerate(ranks):
        for fmt in ("compute_only", "compute_comms"):
            assert result[f"before_{fmt}"] != result["torch_order"], "the orders must differ"
            assert result[f"after_{fmt}"] == result["torch_order"], (rank, fmt)
            assert result[f"bitwise_{fmt}"], f"rank {rank}, {fmt}: differs from torch's"
            assert result[f"hint_name_{fmt}"] == f"interleaved_{fmt}.csv"
            assert "build a ScheduleRRFP with hint='zbv.csv'" in result["other_placement"]
            assert result["unknown_format"] == "NotImplementedError: format='comms' is not implemented"


def test_custom_functions_replace_the_compute_of_their_actions_as_in_torchs_runtime():
    ranks = run_local_world(2, dropin_workers.custom_functions, timeout=180)
    for rank, result in enumerate(ranks):
        assert result["bitwise"], f"rank {rank}: differs from torch's runtime with the callbacks"
        assert result["rrfp"] == result["torch"], rank
        assert len(result["rrfp"]["calls"]) == 2 * 2 * 2 * 4  # steps x stages x (F, B) x mbs
        # Each forward ran once (and once more in torch's first-step shape inference).
        assert result["rrfp"]["forwards"] == [2 * 4 + 1, 2 * 4 + 1]
        assert result["rrfp"]["runtime"]
        assert "register FORWARD and FULL_BACKWARD callbacks instead" in result["overlap"]
        assert {"SEND_F", "RECV_B"} <= set(result["with_comms_kinds"])
        assert result["with_comms_compute"] == result["compute"]


def test_an_input_error_before_any_communication_leaves_the_schedule_usable():
    ranks = run_local_world(2, dropin_workers.reference_reuse, timeout=240)
    assert "shape mismatch" in ranks[0]["errors"]["rrfp"], ranks[0]
    assert ranks[0]["errors"]["torch"].split(":")[0] == ranks[0]["errors"]["rrfp"].split(":")[0]
    for rank, result in enumerate(ranks):
        assert result["steps"] == 3
        assert result["bitwise"], f"rank {rank}: the steps after the error differ from torch's"

