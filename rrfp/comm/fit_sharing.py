"""The duration fits each rank makes of its own stages, shared through the store.

A rank measures only its own stages, but the ``critical`` policy costs every stage's actions
(``rrfp.core.sizes``): after each training step with sizes, a rank writes the fits of its stages
(a few floats per stage and kind) under its key in the pipeline's store, and before the
next such step reads the others' latest: a write and a read a step once every peer of the
pipeline has written, whatever the size of the job. Nothing waits: a fit a peer has not
written yet is read a step later, and until then that stage is costed by the mean of the
fits known. The keys live under the channels' generation prefix (as the failure board's
do).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from rrfp.core.sizes import DurationFit, Key

logger = logging.getLogger(__name__)


def encode_fits(fits: Mapping[Key, DurationFit]) -> str:
    """``fits`` as text (JSON keeps each float exactly)."""
    return json.dumps([[stage, kind, fit.mean, fit.intercept, *fit.slopes]
                       for (stage, kind), fit in sorted(fits.items())])


def decode_fits(text: str) -> dict[Key, DurationFit]:
    return {(int(stage), str(kind)): DurationFit(mean, intercept, tuple(slopes))
            for stage, kind, mean, intercept, *slopes in json.loads(text)}


class FitSharing:
    """This rank's side of the exchange: ``publish`` its fits, ``latest`` the others'.

    ``ranks``: the pipeline's global ranks; ``store`` None (or one rank): nothing shared.
    ``seconds``: the time spent in store round trips so far (what sharing costs a rank).
    """

    def __init__(self, store: dist.Store | None, me: int, ranks: Sequence[int]):
        self._store = store if len(ranks) > 1 else None
        self._me = me
        self._others = [f"fits/{rank}" for rank in ranks if rank != me]
        self._everyone_published = False
        self.seconds = 0.0

    def publish(self, fits: Mapping[Key, DurationFit]) -> None:
        if self._store is None or not fits:
            return
        started = time.perf_counter()
        try:
            self._store.set(f"fits/{self._me}", encode_fits(fits))
        except Exception as e:  # the store gone: the peers cost this rank's stages by means
            logger.warning("global rank %d could not share its duration fits: %s", self._me, e)
        self.seconds += time.perf_counter() - started

    def latest(self) -> dict[Key, DurationFit]:
        """The fits the other ranks last published (those that have)."""
        if self._store is None:
            return {}
        started = time.perf_counter()
        fits: dict[Key, DurationFit] = {}
        try:
            # Once every peer has published, its key stays: one read a step from then on.
            present = self._others if self._everyone_published else [
                key for key in self._others if self._store.check([key])]
            self._everyone_published = len(present) == len(self._others)
            for said in self._store.multi_get(present) if present else ():
                fits.update(decode_fits(said.decode()))
        except Exception as e:  # the store gone: cost the others' stages by what is known
            logger.warning("global rank %d could not read the others' duration fits: %s",
                           self._me, e)
        self.seconds += time.perf_counter() - started
        return fits
