"""Hints: building, validation and derived facts (no process group needed)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining.schedules import _Action, ScheduleInterleaved1F1B

from rrfp.core.actions import B, Edge, F, I, REDUCE_GRAD, W
from rrfp.core.hints import (build_hint, HINT_NAMES, interchangeable, interchangeable_hints,
                             _torch_1f1b_order)

FITTING = {  # hint -> (stages per rank, placement) it needs
    "1F1B": (1, "loop"), "GPipe": (1, "loop"), "Interleaved1F1B": (2, "loop"),
    "LoopedBFS": (2, "loop"), "InterleavedZeroBubble": (2, "loop"),
    "ZBVZeroBubble": (2, "v"), "DualPipeV": (2, "v"), "BF": (2, "loop"), "BFW": (2, "v"),
}


def microbatches_of(hint, stage: int, kinds: frozenset) -> list[int]:
    """``stage``'s microbatches of ``kinds`` in its rank's hint order, read off the order."""
    return [a.microbatch_index for a in hint.orders[hint.stage_to_rank[stage]]
            if a.stage_index == stage and a.computation_type in kinds]


@pytest.mark.parametrize("name", HINT_NAMES)
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_every_named_hint_runs_each_microbatch_once_per_kind(name, num_ranks):
    per_rank, layout = FITTING[name]
    M = 2 * num_ranks
    hint = build_hint(name, num_ranks=num_ranks, num_stages=per_rank * num_ranks,
                      n_microbatches=M, layout=layout)
    assert hint.layout == layout
    for stage in range(hint.num_stages):
        assert sorted(microbatches_of(hint, stage, frozenset({F}))) == list(range(M))
        backward = microbatches_of(hint, stage, frozenset({B, I}))
        assert sorted(backward) == list(range(M))
        weights = microbatches_of(hint, stage, frozenset({W}))
        assert sorted(weights) == sorted(microbatches_of(hint, stage, frozenset({I})))
        rank = hint.stage_to_rank[stage]
        reduces = [a for a in hint.orders[rank] if a.computation_type == REDUCE_GRAD
                   and a.stage_index == stage]
        assert len(reduces) == 1


def test_1f1b_order_is_what_torch_schedule1f1b_runs():
    strs = lambda acts: [str(a) for a in acts]  # noqa: E731
    assert strs(_torch_1f1b_order(0, 2, 4)) == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3".split()
    assert strs(_torch_1f1b_order(1, 2, 4)) == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3".split()


def test_rules_take_streams_and_memory_from_their_reference_schedule():
    shape = dict(num_ranks=2, n_microbatches=4)
    bf = build_hint("bf", num_stages=2, **shape)
    assert bf.policy == "BF" and bf.orders == build_hint("1F1B", num_stages=2, **shape).orders
    bf2 = build_hint("BF", num_stages=4, **shape)
    assert bf2.orders == build_hint("Interleaved1F1B", num_stages=4, **shape).orders
    bfw_v = build_hint("BFW", num_stages=4, layout="v", **shape)
    assert bfw_v.policy == "BFW" and bfw_v.orders == build_hint("ZBVZeroBubble", num_stages=4, **shape).orders
    with pytest.raises(ValueError, match="BF rule needs a loop placement"):
        build_hint("BF", num_stages=4, layout="v", **shape)


def test_peaks_edges_and_message_orders():
    hint = build_hint("1F1B", num_ranks=4, num_stages=4, n_microbatches=8)
    assert hint.plan.stage_peaks == {0: 4, 1: 3, 2: 2, 3: 1}
    assert hint.plan.streams_share_one_order()
    v = build_hint("ZBVZeroBubble", num_ranks=2, num_stages=4, n_microbatches=4)
    # Stages 1 and 2 share rank 1: their edge passes tensors locally, with no channel.
    assert v.plan.remote_edges == (Edge(0, 1), Edge(1, 0), Edge(2, 3), Edge(3, 2))
    bfs = build_hint("LoopedBFS", num_ranks=2, num_stages=4, n_microbatches=4)
    assert bfs.plan.message_order(Edge(0, 1)) == (0, 1, 2, 3)
    assert bfs.plan.message_order(Edge(1, 0)) == (3, 2, 1, 0)
    assert not bfs.plan.streams_share_one_order()


def test_class_csv_and_dict_sources_give_the_same_hint(tmp_path):
    shape = dict(num_ranks=2, num_stages=4, n_microbatches=4)
    by_name = build_hint("Interleaved1F1B", **shape)
    by_class = build_hint(ScheduleInterleaved1F1B, **shape)
    assert by_class.orders == by_name.orders
    path = tmp_path / "hint.csv"
    path.write_text("\n".join(",".join(str(a) for a in by_name.orders[r]) for r in range(2)) + "\n")
    assert build_hint(str(path), **shape).orders == by_name.orders
    as_strings = {r: [str(a) for a in acts] for r, acts in by_name.orders.items()}
    assert build_hint(as_strings, **shape).orders == by_name.orders


@pytest.mark.parametrize("source,message", [
    ("Zigzag", "unknown hint 'Zigzag'"),
    ("hints/missing.csv", "hint file 'hints/missing.csv' not found"),
    ("missing.CSV", "hint file 'missing.CSV' not found"),
    ({0: ["0F0", "0X1"], 1: []}, "is not an action like"),
    ({0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F0", "1B0"]}, "does not fit a pipeline"),
    ({0: ["0F0", "0F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}, "runs 0F0 twice"),
    ({0: ["0F0", "0SEND_F0", "0F1", "0B0", "0B1"], 1: ["1F0", "1B0", "1F1", "1B1"]}, "not a compute action"),
    (int, "is not a torch.distributed.pipelining schedule"),
])
def test_malformed_hints_raise_value_errors_that_say_what_is_wrong(source, message):
    with pytest.raises(ValueError, match=message):
        build_hint(source, num_ranks=2, num_stages=2, n_microbatches=2)


def test_hints_that_do_not_fit_the_pipeline_shape():
    with pytest.raises(ValueError, match="runs one stage per rank"):
        build_hint("GPipe", num_ranks=2, num_stages=4, n_microbatches=4)
    with pytest.raises(ValueError, match="multiple of the number of rounds"):
        build_hint("Interleaved1F1B", num_ranks=2, num_stages=4, n_microbatches=5)
    with pytest.raises(ValueError, match="n_microbatches must be >= 1"):
        build_hint("1F1B", num_ranks=2, num_stages=2, n_microbatches=0)
    with pytest.raises(ValueError, match="do not divide evenly"):
        build_hint("1F1B", num_ranks=2, num_stages=3, n_microbatches=4)


def test_forward_only_hint_keeps_forwards_in_order():
    hint = build_hint("ZBVZeroBubble", num_ranks=2, num_stages=4, n_microbatches=4)
    fwd = hint.forward_only()
    for r in range(2):
        assert list(fwd.orders[r]) == [a for a in hint.orders[r] if a.computation_type == F]
    assert _Action(0, F, 0) in fwd.orders[0]


def test_interchangeable_hints_keep_the_placement_and_every_streams_order():
    def built(name: str, ranks: int, stages: int, layout: str = "loop"):
        return build_hint(name, num_ranks=ranks, num_stages=stages, n_microbatches=8,
                          layout=layout)

    # Full backwards, one stage per rank: every stage runs F and B in microbatch order.
    assert set(interchangeable_hints(built("1F1B", 4, 4))) == {"GPipe", "Interleaved1F1B", "BF"}
    # Split backward on a V: the BFW rule takes ZBV's streams; DualPipeV orders them
    # differently.
    assert set(interchangeable_hints(built("ZBVZeroBubble", 4, 8, "v"))) == {"BFW"}
    assert not interchangeable(built("ZBVZeroBubble", 4, 8, "v"), built("DualPipeV", 4, 8, "v"))
    # Split backward is never interchangeable with whole backwards, nor two placements.
    assert not interchangeable(built("InterleavedZeroBubble", 4, 8), built("Interleaved1F1B", 4, 8))
    assert not interchangeable(built("ZBVZeroBubble", 4, 8, "v"), built("BFW", 4, 8))
    # One stream's order changed (stage 0's last two backwards swapped): not interchangeable.
    one_f_one_b = built("1F1B", 2, 2)
    orders = {r: list(acts) for r, acts in one_f_one_b.orders.items()}
    last = [i for i, a in enumerate(orders[0]) if a.computation_type == B][-2:]
    orders[0][last[0]], orders[0][last[1]] = orders[0][last[1]], orders[0][last[0]]
    swapped = build_hint(orders, num_ranks=2, num_stages=2, n_microbatches=8)
    assert not interchangeable(one_f_one_b, swapped)
    assert interchangeable(one_f_one_b, built("GPipe", 2, 2))
