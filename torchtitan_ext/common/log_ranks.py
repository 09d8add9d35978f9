"""Which ranks print torchtitan's log lines: by default only the rank that logs the loss.

torchtitan logs on every rank and leaves the filtering to its ``run_train.sh``
(``torchrun --local-ranks-filter $LOG_RANK``); with pipeline parallelism the other ranks
print ``loss: -1``, and torchtitan warns unless ``LOG_RANK`` names the loss rank. Here the
process itself keeps quiet instead: only the ranks in ``LOG_RANK`` (torchtitan's variable;
comma-separated global ranks) print info and warning lines, by default the rank torchtitan
picks to log metrics (``_get_metrics_rank``: the one with the loss). Errors print everywhere.

Which rank that is is known only once the device mesh is built, after torchtitan logged
its start-up on every rank: from ``hold_until_rank_known`` on, each rank holds its info and
warning lines (Python's warnings too, made log lines) and ``print_only_on`` prints them
where they belong.
"""

from __future__ import annotations

import atexit
import logging
import os

from torchtitan.tools.logging import logger

LOG_RANK = "LOG_RANK"


def log_ranks(loss_rank: int) -> set[int]:
    """The ranks that print: ``LOG_RANK`` if set, else ``loss_rank``."""
    text = os.environ.get(LOG_RANK, "").strip()
    if not text:
        return {loss_rank}
    try:
        return {int(rank) for rank in text.split(",")}
    except ValueError:
        raise ValueError(f"{LOG_RANK}={text!r} must list ranks separated by commas, "
                         f"e.g. {LOG_RANK}=0,{loss_rank}") from None


class _ErrorsOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


WARNINGS_LOGGER = "py.warnings"
"""The logger ``logging.captureWarnings`` sends Python's warnings to."""


class _Held(logging.Filter):
    """Keeps the records below ERROR instead of letting them print (errors pass)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        self.records.append(record)
        return False


_held: _Held | None = None


def hold_until_rank_known() -> None:
    """From now until ``print_only_on``: every rank holds its info and warning lines, and
    Python's warnings become log lines (idempotent). On the root logger and the warnings'
    logger themselves: torchtitan's ``init_logger`` replaces the root's handlers, not its
    filters. A process that exits before the rank is known prints them on rank 0."""
    global _held
    if _held is not None:
        return
    logging.captureWarnings(True)
    _held = _Held()
    for name in ("", WARNINGS_LOGGER):
        logging.getLogger(name).addFilter(_held)
    atexit.register(_release, os.environ.get("RANK", "0") == "0")


def _release(prints: bool) -> None:
    global _held
    if _held is None:
        return
    held, _held = _held, None
    for name in ("", WARNINGS_LOGGER):
        logging.getLogger(name).removeFilter(held)
    if prints:
        for record in held.records:
            logging.getLogger().callHandlers(record)


def print_only_on(ranks: set[int], rank: int) -> None:
    """Keep this process's log handlers to errors unless ``rank`` is one of ``ranks``; the
    lines held since ``hold_until_rank_known`` print on those ranks only.

    Call once torchtitan's logger is set up: the filter goes on its handlers, so it also
    covers records of child loggers (``rrfp.runtime.schedule``, Python's warnings) that
    propagate to them.
    """
    if rank not in ranks:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_ErrorsOnly())
    _release(rank in ranks)


def warn_if_loss_hidden(loss_rank: int) -> None:
    """Replaces torchtitan's ``ensure_pp_loss_visible`` check, which asks for ``LOG_RANK``
    in a ``run_train.sh`` this project does not use."""
    if loss_rank not in log_ranks(loss_rank):
        logger.warning(f"the loss is logged by rank {loss_rank} only, and {LOG_RANK}="
                       f"{os.environ[LOG_RANK]} leaves it out: add {loss_rank} to {LOG_RANK}, "
                       f"or unset {LOG_RANK} to see rank {loss_rank} alone")
