"""The one check of a user's ``Settings``: each field parsed, and the whole set checked
against the hint it runs over and the device it runs on.

``ScheduleRRFP`` calls it at construction (and again for a new hint), torchtitan_ext before
it builds anything, so a setting that would be refused is refused with the same words,
naming the field, wherever it was written.
"""

from __future__ import annotations

from dataclasses import dataclass

from rrfp.core.hints import Hint
from rrfp.core.limits import check_limits, first_step_limits
from rrfp.core.settings import (BufferLimit, check_limit_can_be_measured, COORDINATIONS,
                                parse_buffer_limit, parse_launch_depth, parse_meter_every,
                                parse_policy, parse_stall_timeout, Settings)


@dataclass(frozen=True)
class CheckedSettings:
    """``Settings`` as the runtime reads them: each field parsed."""

    given: Settings
    buffer_limit: BufferLimit
    policy: str | None
    """The policy's name as registered; None: the default for the hint and limits."""
    launch_depth: int | None
    """None: no bound."""
    stall_timeout: float
    fixed_every: int
    tune_within: BufferLimit | None = None
    """The self-driving budget (None: the setting runs as given)."""
    tune_hints: bool = False
    """Self-driving's candidates also rank by the interchangeable hints."""


def check_settings(settings: Settings, hint: Hint, *, free_memory_known: bool,
                   device: object) -> CheckedSettings:
    """``settings`` parsed, or ``ValueError("<field>: <what to write instead>")`` for the
    first field that cannot run over ``hint`` on ``device`` (``free_memory_known``: whether
    the device tells its free memory, which ``buffer_limit="auto"`` reads)."""
    if not isinstance(settings, Settings):
        raise ValueError(f"settings must be an rrfp.Settings, got {type(settings).__name__}: "
                         "pass settings=rrfp.Settings(buffer_limit=..., ...)")
    parsed: dict[str, object] = {}

    def check(name: str, parse, *args) -> None:
        try:
            parsed[name] = parse(getattr(settings, name), *args)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None

    check("variable_shapes", a_flag, "variable_shapes")
    check("meter_activations", a_flag, "meter_activations")
    check("policy", parse_policy)
    check("launch_depth", parse_launch_depth)
    check("buffer_limit", _limit_over, hint, parsed["policy"] == "fixed")
    check("buffer_limit", _measurable, settings.meter_activations, free_memory_known, device)
    check("coordination", _one_of, "coordination", COORDINATIONS)
    check("stall_timeout", parse_stall_timeout)
    check("meter_every", parse_meter_every)
    check("fixed_every", _fixed_every, hint, parsed["buffer_limit"])
    check("report_folder", _a_folder)
    check("tune_within", _budget, settings, parsed["policy"], free_memory_known, device)
    check("tune_hints", _with_budget, parsed["tune_within"])
    return CheckedSettings(settings, parsed["buffer_limit"], parsed["policy"],
                           parsed["launch_depth"], parsed["stall_timeout"],
                           parsed["fixed_every"], parsed["tune_within"], parsed["tune_hints"])


def _limit_over(spec: object, hint: Hint, fixed_order: bool) -> BufferLimit:
    """The limit, once its first step's limits are known to run over ``hint``."""
    first_step_limits(spec, hint, fixed_order=fixed_order)
    return parse_buffer_limit(spec)


def _measurable(spec: object, meter_activations: bool, free_memory_known: bool,
                device: object) -> BufferLimit:
    check_limit_can_be_measured(spec, meter_activations=meter_activations,
                                free_memory_known=free_memory_known, device=device)
    return parse_buffer_limit(spec)


def _fixed_every(every: object, hint: Hint, limit: BufferLimit) -> int:
    """0 (no in-run A/B) or k >= 2, where the limits let the hint's fixed order run."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 0 or every == 1:
        raise ValueError(f"fixed_every must be 0 (no A/B) or an int >= 2 (every k-th "
                         f"training step in the fixed order), got {every!r}")
    if every:
        check_limits(first_step_limits(limit, hint), hint, limit.spec,
                     fixed_order=f"fixed_every={every}")
    return every


TUNED_DEFAULTS = {"buffer_limit": "hint", "policy": None, "fixed_every": 0}
"""What ``tune_within`` needs of the settings it chooses: their defaults."""


def chosen_beside_budget(settings: Settings, policy: str | None) -> list[str]:
    """The fields of ``TUNED_DEFAULTS`` that ``settings`` set away from their defaults
    (``policy``: the parsed policy), which a ``tune_within`` budget refuses."""
    chosen = {"buffer_limit": parse_buffer_limit(settings.buffer_limit) != BufferLimit(None),
              "policy": policy is not None, "fixed_every": settings.fixed_every != 0}
    return [name for name, set_ in chosen.items() if set_]


def _budget(spec: object, settings: Settings, policy: str | None, free_memory_known: bool,
            device: object) -> BufferLimit | None:
    """The self-driving budget, where nothing else it chooses was set (None or ``""``:
    none)."""
    if spec is None or spec == "":
        return None
    budget = parse_buffer_limit(spec)
    if budget.auto:
        raise ValueError("'auto' leaves the budget to the device: give the bytes RRFP may "
                         "use per rank (e.g. '12GiB'), 'busiest' or 'hint+k'")
    given = chosen_beside_budget(settings, policy)
    if given:
        defaults = ", ".join(f"{name}={TUNED_DEFAULTS[name]!r}" for name in given)
        raise ValueError(
            f"tune_within={spec!r} chooses buffer_limit and the policy itself and runs its "
            f"own in-run A/B: leave {', '.join(given)} at "
            f"{'the default' if len(given) == 1 else 'their defaults'} ({defaults}), or drop "
            "tune_within to run the setting you give")
    check_limit_can_be_measured(spec, meter_activations=settings.meter_activations,
                                free_memory_known=free_memory_known, device=device)
    return budget


def _with_budget(value: object, budget: BufferLimit | None) -> bool:
    """``tune_hints``: a flag, set only beside a ``tune_within`` budget."""
    hints = a_flag(value, "tune_hints")
    if hints and budget is None:
        raise ValueError("tune_hints=True widens the self-driving mode's candidates: set "
                         "tune_within to a memory budget (e.g. 'hint+2') with it, or drop it")
    return hints


def a_flag(value: object, name: str) -> bool:
    """``value`` if it is a bool (TOML and the command line hand over what was written)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _one_of(value: object, name: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")
    return value  # type: ignore[return-value]


def _a_folder(value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"report_folder must be a folder's path or None, got {value!r}")
    return value
