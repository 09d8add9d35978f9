"""The errors a pipeline step raises when it cannot complete (``rrfp`` exports both)."""

from __future__ import annotations


class PipelineStallError(RuntimeError):
    """No action became ready within ``stall_timeout``: a peer never sent, or died."""


class PeerFailedError(PipelineStallError):
    """Another rank of the pipeline failed its step (it said so through the store,
    ``rrfp.comm.board``)."""

    def __init__(self, message: str, failed_rank: int):
        super().__init__(message)
        self.failed_rank = failed_rank
        """Global rank of the rank that failed first."""


class StoreLostError(PipelineStallError):
    """The job's store is gone (the host that serves it died): no failure could be told
    any more, so every rank stops (``rrfp.comm.board``)."""
