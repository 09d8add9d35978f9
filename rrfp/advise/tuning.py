"""The self-driving tuner's predictions (``rrfp.core.tuning``): each candidate replayed on
the job's measured steps by the advisor, in a process of its own.

``python -m rrfp.advise.tuning`` reads a pickled ``(MeasuredRun, limits, hints)`` on its
standard input and writes the pickled ``(list[Predicted], CPU seconds it took)`` on its
standard output: the runtime starts it at ``nice 19``, so that predicting takes little of
a core training uses (and, as a fresh interpreter, it imports nothing of the training
script), and counts its CPU against the predictions' share (``rrfp.advise.cost``). It
exits once the runtime's process is gone (``rrfp.advise.end_with_parent``).
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Sequence

from rrfp.advise import end_with_parent
from rrfp.advise.measured import MeasuredRun
from rrfp.advise.predict import NAMED_POLICIES, predictions, Setting
from rrfp.core.tuning import Candidate, Predicted


def predict_candidates(run: MeasuredRun, limits: Sequence[str],
                       hints: Sequence[str] = ()) -> list[Predicted]:
    """Each candidate at ``limits`` (the default policy and the advisor's named ones)
    replayed on the run's steps, each told the sizes and not (``Candidate.use_sizes``);
    and each of ``hints`` (interchangeable with the run's) ranking at the same limits
    under its default policy, told the sizes and not. Settings that run alike are
    predicted once, the first of them a candidate (``predictions`` says which: told the
    sizes or not, a policy that does not read them, or steps whose sizes do not tell
    microbatches apart); a hint the limits do not suit (below its own peaks where its
    streams need them) is no candidate."""
    own = run.hint.name
    settings = {Candidate(limit, policy, use): Setting(own, limit, policy, use)
                for limit in limits for policy in (None, *NAMED_POLICIES)
                for use in (True, False)}
    settings.update({Candidate(limit, None, use, hint): Setting(hint, limit, None, use,
                                                                limits_on_run_hint=True)
                     for hint in hints for limit in limits for use in (True, False)})
    _, rows = predictions(run, list(settings.values()))
    by_setting = {row.setting: row.speedup for row in rows}
    return [Predicted(candidate, by_setting[setting])
            for candidate, setting in settings.items() if setting in by_setting]


def main() -> None:
    end_with_parent()
    run, limits, hints = pickle.load(sys.stdin.buffer)
    predicted = predict_candidates(run, limits, hints)
    pickle.dump((predicted, time.process_time()), sys.stdout.buffer)


if __name__ == "__main__":
    main()
