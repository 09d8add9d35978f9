"""Which ranks print torchtitan's log lines: by default only the rank that logs the loss.

torchtitan logs on every rank and leaves the filtering to its ``run_train.sh``
(``torchrun --local-ranks-filter $LOG_RANK``); with pipeline parallelism the other ranks
print ``loss: -1``, and torchtitan warns unless ``LOG_RANK`` names the loss rank. Here the
process itself keeps quiet instead: only the ranks in ``LOG_RANK`` (torchtitan's variable;
comma-separated global ranks) print info and warning lines, by default the rank torchtitan
picks to log metrics (``_get_metrics_rank``: the one with the loss). Errors print everywhere.
"""

from __future__ import annotations

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


def print_only_on(ranks: set[int], rank: int) -> None:
    """Keep this process's log handlers to errors unless ``rank`` is one of ``ranks``.

    Call once torchtitan's logger is set up: the filter goes on its handlers, so it also
    covers records of child loggers (``rrfp.runtime.schedule``) that propagate to them.
    """
    if rank in ranks:
        return
    for handler in logging.getLogger().handlers:
        handler.addFilter(_ErrorsOnly())


def warn_if_loss_hidden(loss_rank: int) -> None:
    """Replaces torchtitan's ``ensure_pp_loss_visible`` check, which asks for ``LOG_RANK``
    in a ``run_train.sh`` this project does not use."""
    if loss_rank not in log_ranks(loss_rank):
        logger.warning(f"the loss is logged by rank {loss_rank} only, and {LOG_RANK}="
                       f"{os.environ[LOG_RANK]} leaves it out: add {loss_rank} to {LOG_RANK}, "
                       f"or unset {LOG_RANK} to see rank {loss_rank} alone")
