"""The self-driving tuner's predictions (``rrfp.core.tuning``): each candidate replayed on
the job's measured steps by the advisor, in a process of its own.

``main`` (``python -m rrfp.advise.tuning``) reads pickled ``(MeasuredRun, limits,
hints)`` requests on its standard input, one after another, and answers each on its
standard output with the pickled ``(list[Predicted], CPU seconds it took)``, until its input closes.
``PredictionProcess`` starts it at ``nice 19`` at the job's first prediction, so that
predicting takes little of a core training uses (and, as a fresh interpreter, it imports
nothing of the training script), and keeps it for the later ones: importing torch, most
of a prediction's CPU, is paid once. The runtime counts that CPU against the
predictions' share (``rrfp.advise.cost``). The process exits once the runtime's process
is gone (``rrfp.advise.end_with_parent``).
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO

from rrfp.advise import child_environment, end_with_parent, lower_priority
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


ENTRY = "from rrfp.advise.tuning import main; main()"
"""What a prediction process runs (``python -c``)."""


class PredictionProcess:
    """``predict_candidates`` in a process of its own at ``nice 19`` (where every core
    trains it gets a small share of one, so a decision comes late but comes;
    ``SCHED_IDLE``, the advisor's verdict's priority, could starve it), started by the
    first prediction and kept for the next. One prediction at a time; ``close`` may come
    from another thread while one runs (it then fails)."""

    def __init__(self) -> None:
        self._child: subprocess.Popen | None = None
        self._errors: IO[bytes] | None = None
        """The process's standard error, read where a prediction fails."""

    @property
    def started(self) -> bool:
        """Whether a process is running (the next prediction does not start one)."""
        return self._child is not None

    def predict(self, run: MeasuredRun, limits: Sequence[str], hints: Sequence[str]
                ) -> tuple[list[Predicted], float]:
        """Each candidate's prediction, and the CPU seconds the process took for it (its
        start-up included where this prediction started it). A process that fails is
        closed: the next prediction starts another."""
        if self._child is None:
            self._start()
        child, errors = self._child, self._errors
        assert child is not None and errors is not None
        try:
            pickle.dump((run, list(limits), list(hints)), child.stdin)
            child.stdin.flush()
            return pickle.load(child.stdout)
        except (OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
            said = _last_words(errors)
            if self._child is child:
                self.close()
            raise RuntimeError(f"the self-driving prediction failed: {said or repr(e)}") from e

    def _start(self) -> None:
        errors = tempfile.TemporaryFile()
        try:
            # Not ``-m``: importing rrfp imports this module, which ``-m`` would run anew.
            self._child = subprocess.Popen([sys.executable, "-c", ENTRY],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=errors, env=child_environment())
        except BaseException:
            errors.close()
            raise
        self._errors = errors
        try:
            lower_priority(self._child.pid, idle=False)
        except OSError:  # it ended before it could be lowered, or the OS refuses: it runs
            pass

    def close(self) -> None:
        """End the process: killed, as it holds nothing but a prediction no one waits for."""
        child, errors, self._child, self._errors = self._child, self._errors, None, None
        if child is None:
            return
        child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout, errors):
            try:
                stream.close()
            except OSError:  # a request half written: the pipe is gone
                pass


def _last_words(errors: IO[bytes]) -> str:
    """The end of what a failed prediction process wrote on its standard error."""
    try:
        errors.seek(0)
        return errors.read().decode(errors="replace")[-2000:]
    except (OSError, ValueError):  # closed meanwhile
        return ""


def main() -> None:
    end_with_parent()
    taken = 0.0
    while True:
        try:
            run, limits, hints = pickle.load(sys.stdin.buffer)
        except EOFError:
            return
        predicted = predict_candidates(run, limits, hints)
        cpu = time.process_time()
        pickle.dump((predicted, cpu - taken), sys.stdout.buffer)
        sys.stdout.buffer.flush()
        taken = cpu


if __name__ == "__main__":
    main()
