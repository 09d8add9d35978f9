"""The mutation check (``python -m benchmarks.mutation_check``) can apply every mutation and
run its tests: a target text that the code no longer has, or a test that moved, fails here,
not silently in a long run."""

from __future__ import annotations

from benchmarks.mutation_check import Mutation, MUTATIONS, target_problems


def test_every_mutation_finds_its_target_text_once_and_its_tests():
    assert len(MUTATIONS) >= 15
    assert target_problems() == []


def test_a_target_that_is_gone_is_reported():
    gone = Mutation("gone", "a feature", "rrfp/core/loop.py", "text that is not in the loop", "x", ())
    moved = Mutation("moved", "a feature", "rrfp/no_such_module.py", "x", "y", ())
    assert target_problems([gone, moved]) == [
        "gone: the text to mutate occurs 0 times in rrfp/core/loop.py (expected once)",
        "moved: rrfp/no_such_module.py does not exist"]


def test_a_test_that_is_gone_is_reported():
    kept = MUTATIONS[0]
    selection = ("tests/test_arbiter.py::test_no_such_test|some and case",
                 "tests/test_no_such_file.py",
                 "tests/test_arbiter.py::test_no_deadlock_and_memory_bound_under_random_timings[x]")
    rotten = Mutation("rotten", "a feature", kept.path, kept.old, kept.new, selection)
    assert target_problems([rotten]) == [
        "rotten: tests/test_arbiter.py has no test test_no_such_test",
        "rotten: the test file tests/test_no_such_file.py does not exist"]
