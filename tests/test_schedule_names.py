"""torchtitan looks schedule names up through torch's ``get_schedule_class`` (its main
branch when a ``ParallelismConfig`` is made, importing it at that moment):
``register_with_torch`` makes torch's function know the RRFP names."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from rrfp import ScheduleRRFP
from torchtitan_ext.common.schedules import register_with_torch, ScheduleRRFPSingleStage


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setattr(torch_schedules, "get_schedule_class",
                        torch_schedules.get_schedule_class)
    register_with_torch()
    register_with_torch()  # idempotent: wrapped once


def test_torchs_get_schedule_class_returns_rrfp_for_rrfp_names(registered):
    from torch.distributed.pipelining.schedules import get_schedule_class  # as titan does

    assert get_schedule_class("RRFP") is ScheduleRRFP
    assert get_schedule_class("rrfp-zbvzerobubble") is ScheduleRRFP
    assert get_schedule_class("RRFP-1F1B") is ScheduleRRFPSingleStage
    assert get_schedule_class("Interleaved1F1B") is torch_schedules.ScheduleInterleaved1F1B
    assert not hasattr(get_schedule_class.__wrapped__, "__wrapped__")
    with pytest.raises(ValueError, match="Unknown schedule name 'Interleved1F1B'"):
        get_schedule_class("Interleved1F1B")
    with pytest.raises(ValueError, match="unknown RRFP schedule 'RRFP-Foo'"):
        get_schedule_class("RRFP-Foo")


def test_without_registration_torch_refuses_rrfp_names():
    with pytest.raises(ValueError, match="Unknown schedule name 'RRFP'"):
        torch_schedules.get_schedule_class("RRFP")
