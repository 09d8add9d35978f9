"""The mutation check (``python -m benchmarks.mutation_check``) can apply every mutation:
a target text that the code no longer has fails here, not silently in a long run."""

from __future__ import annotations

from benchmarks.mutation_check import Mutation, MUTATIONS, target_problems


def test_every_mutation_finds_its_target_text_once():
    assert len(MUTATIONS) >= 15
    assert target_problems() == []


def test_a_target_that_is_gone_is_reported():
    gone = Mutation("gone", "a feature", "rrfp/loop.py", "text that is not in the loop", "x", ())
    moved = Mutation("moved", "a feature", "rrfp/no_such_module.py", "x", "y", ())
    assert target_problems([gone, moved]) == [
        "gone: the text to mutate occurs 0 times in rrfp/loop.py (expected once)",
        "moved: rrfp/no_such_module.py does not exist"]
