"""The lowering pass on its own: ``lower(orders)`` derives each rule of a step (streams,
dependencies, messages, release points, microbatches held) from per-rank action orders
written out here by hand, so each expectation can be checked against the order itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

from rrfp.core.actions import _Action, B, Edge, F, I, REDUCE_GRAD, W
from rrfp.core.plan import lower, StepPlan


@dataclass(frozen=True)
class Orders:
    num_stages: int
    stage_to_rank: Mapping[int, int]
    orders: Mapping[int, Sequence[_Action]]


def act(text: str) -> _Action:
    """``"1F0"``: stage 1, forward, microbatch 0 (torch's own spelling)."""
    return _Action.from_str(text)


def acts(text: str) -> list[_Action]:
    return [act(t) for t in text.split()]


def one_f_one_b() -> StepPlan:
    """Two ranks, a stage each, three microbatches, 1F1B's orders."""
    return lower(Orders(2, {0: 0, 1: 1}, {0: acts("0F0 0F1 0B0 0F2 0B1 0B2"),
                                          1: acts("1F0 1B0 1F1 1B1 1F2 1B2")}))


def v_split_backward() -> StepPlan:
    """Two ranks, V placement (stages 0 and 3 on rank 0, 1 and 2 on rank 1), backward
    split into I and W on every stage, two microbatches."""
    return lower(Orders(4, {0: 0, 1: 1, 2: 1, 3: 0}, {
        0: acts("0F0 0F1 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 0I1 0W1"),
        1: acts("1F0 1F1 2F0 2F1 2I0 2W0 1I0 1W0 2I1 2W1 1I1 1W1")}))


def test_each_stage_has_a_forward_an_input_gradient_and_a_weight_gradient_stream():
    plan = one_f_one_b()
    assert [n.action for n in plan.stream(0, "F")] == acts("0F0 0F1 0F2")
    assert [n.action for n in plan.stream(0, "BI")] == acts("0B0 0B1 0B2")
    # A full backward both sends the input gradient and accumulates the weight gradient.
    assert [n.action for n in plan.stream(0, "GRAD")] == acts("0B0 0B1 0B2")
    split = v_split_backward()
    assert [n.action for n in split.stream(3, "BI")] == acts("3I0 3I1")
    assert [n.action for n in split.stream(3, "GRAD")] == acts("3W0 3W1")


def test_dependencies_name_every_producer_and_the_local_ones_by_position():
    plan = one_f_one_b()
    rank0 = plan.ranks[0]
    backward = rank0.node(act("0B1"))
    assert set(backward.producers) == {act("0F1"), act("1B1")}
    assert backward.deps == (rank0.index_of[act("0F1")],)  # the gradient comes from rank 1
    forward = plan.ranks[1].node(act("1F2"))
    assert forward.producers == (act("0F2"),) and forward.deps == ()
    weight = v_split_backward().ranks[0].node(act("3W1"))
    assert weight.producers == (act("3I1"),)


def test_a_hand_off_between_stages_of_one_rank_is_no_message():
    plan = v_split_backward()
    rank0 = plan.ranks[0]
    # Stage 2 (rank 1) feeds stage 3 (rank 0): a message; stage 3's I feeds stage 2's I
    # over the wire too; stage 1 -> 2 stays on rank 1.
    assert rank0.node(act("3F0")).message == (Edge(2, 3), 0)
    assert plan.ranks[1].node(act("2F0")).message is None
    assert plan.ranks[1].node(act("2F0")).deps == (plan.ranks[1].index_of[act("1F0")],)
    assert rank0.node(act("3I0")).sends == (Edge(3, 2),)
    assert plan.ranks[1].node(act("1F0")).sends == ()
    # The executor hands such outputs over in place: forward to stage 2, gradient to 1.
    assert plan.ranks[1].node(act("1F0")).hands_to == 2
    assert plan.ranks[1].node(act("2I0")).hands_to == 1
    assert rank0.node(act("3F0")).hands_to is None and rank0.node(act("3I0")).hands_to is None
    assert rank0.node(act("0I0")).hands_to is None  # the first stage's gradient goes nowhere
    assert plan.remote_edges == (Edge(0, 1), Edge(1, 0), Edge(2, 3), Edge(3, 2))


def test_every_edge_between_ranks_carries_its_messages_in_the_producers_order():
    plan = one_f_one_b()
    assert plan.message_orders == {Edge(0, 1): (0, 1, 2), Edge(1, 0): (0, 1, 2)}
    assert plan.sender(Edge(1, 0), 2) == act("1B2")
    assert plan.message_position(Edge(0, 1), 2) == 2
    reordered = lower(Orders(2, {0: 0, 1: 1}, {0: acts("0F1 0F0 0B1 0B0"),
                                               1: acts("1F1 1B1 1F0 1B0")}))
    assert reordered.message_orders[Edge(0, 1)] == (1, 0)


def test_a_microbatch_is_released_at_its_last_backward_piece_on_the_stage():
    assert one_f_one_b().releases(0) == tuple(acts("0B0 0B1 0B2"))
    split = v_split_backward()
    assert split.releases(3) == tuple(acts("3W0 3W1"))  # after I autograd keeps W's state
    assert split.release_of(0, 1) == act("0W1")
    forward_only = lower(Orders(2, {0: 0, 1: 1}, {0: acts("0F0 0F1"), 1: acts("1F0 1F1")}))
    assert forward_only.releases(1) == tuple(acts("1F0 1F1"))


def test_the_microbatches_held_and_the_peaks_follow_the_order():
    plan = one_f_one_b()
    assert plan.ranks[0].held == (0, 1, 2, 1, 2, 1, 0)
    assert plan.ranks[1].held == (0, 1, 0, 1, 0, 1, 0)
    assert plan.stage_peaks == {0: 2, 1: 1}
    assert plan.rank_peaks() == {0: 2, 1: 1}
    # Both of rank 0's V stages hold microbatches at once: the rank's peak is the most
    # they hold together, not the sum of their own peaks.
    split = v_split_backward()
    assert split.stage_peaks[0] == 2 and split.stage_peaks[3] == 1
    assert split.rank_peaks()[0] == 3
    assert split.ranks[0].future_peaks[split.ranks[0].index_of[act("0I0")]] == 2


def test_the_streams_share_one_order_only_when_forwards_and_backwards_agree():
    assert one_f_one_b().streams_share_one_order()
    reversed_backwards = lower(Orders(2, {0: 0, 1: 1}, {0: acts("0F0 0F1 0B1 0B0"),
                                                       1: acts("1F0 1F1 1B1 1B0")}))
    assert not reversed_backwards.streams_share_one_order()


def test_a_gradient_reduction_waits_for_its_stages_last_weight_gradient():
    reduce_grad = _Action(0, REDUCE_GRAD, None)
    plan = lower(Orders(2, {0: 0, 1: 1}, {0: [*acts("0F0 0F1 0B0 0B1"), reduce_grad],
                                          1: acts("1F0 1B0 1F1 1B1")}))
    node = plan.ranks[0].node(reduce_grad)
    assert node.producers == (act("0B1"),)
    assert node.kind == "R" and not node.releases


@pytest.mark.parametrize("kind", [F, B, I, W])
def test_an_action_of_another_rank_is_not_in_this_ranks_plan(kind):
    plan = one_f_one_b()
    with pytest.raises(KeyError, match="is not in rank 0's hint"):
        plan.ranks[0].node(_Action(1, kind, 0))
