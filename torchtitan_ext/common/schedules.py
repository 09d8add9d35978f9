"""RRFP as torchtitan pipeline schedules: ``pipeline_parallel_schedule = "RRFP-<hint>"``.

Shared by both torchtitan versions: the names, the check of a configuration, and building
ScheduleRRFP from torchtitan's stages (``build_schedule``). How torchtitan is made to use
them is each version's adapter: ``titan_0_2.patches`` (0.2.2), ``titan_0_3.pipelining`` (0.3).


``"RRFP"`` is the recommended setting for torchtitan's default placement (loop, 2 or more
stages per rank): the Interleaved1F1B hint under ScheduleRRFP's default policy, which
measured never slower than Interleaved1F1B itself; ``"RRFP-<hint>"`` takes any hint
ScheduleRRFP accepts by name (the paper's BF rule is ``"RRFP-BF"``). Stage placement and stages per rank follow the hint exactly as torchtitan does for
the hint itself. torchtitan 0.2.2 places V-shaped stages only when the schedule class *is*
ZBVZeroBubble or DualPipeV (an identity check) and picks the loss-logging rank by name
(both versions): the adapters show torchtitan ``torch_view_name`` instead of an RRFP name
there. torchtitan's own code is not edited.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch.distributed as dist
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor

from rrfp import ScheduleRRFP
from rrfp.core.hints import build_hint, Hint, HINT_NAMES, rule_reference, RULE_NAMES
from rrfp.core.checks import a_flag, check_settings as check_rrfp_settings, chosen_beside_budget
from rrfp.core.settings import parse_policy, Settings
from rrfp.core.text import counted
from rrfp.devices.platform import platform_for
from torchtitan_ext.common.batch import batch_settings
from torchtitan_ext.config import RRFPConfig

PREFIX = "RRFP"
DEFAULT_HINT = "Interleaved1F1B"
"""What the bare name ``RRFP`` means: on that placement the BF rule is slower than
Interleaved1F1B even with uniform times (benchmarks/results/simulation.md)."""
_V_HINTS = {"ZBVZeroBubble", "DualPipeV"}
_SINGLE_STAGE_HINTS = {"1F1B", "GPipe"}


class ScheduleRRFPSingleStage(ScheduleRRFP):
    """ScheduleRRFP for hints with one stage per rank: torchtitan sizes stages per rank by
    ``issubclass(schedule_class, PipelineScheduleSingle)``, so it is registered as one."""


PipelineScheduleSingle.register(ScheduleRRFPSingleStage)


def hint_of(schedule_name: str) -> str | None:
    """The hint an RRFP schedule name asks for (None for other schedule names).

    Raises ValueError for an ``RRFP-`` name whose hint is unknown.
    """
    if schedule_name.upper() == PREFIX:
        return DEFAULT_HINT
    if not schedule_name.upper().startswith(PREFIX + "-"):
        return None
    wanted = schedule_name[len(PREFIX) + 1:]
    for name in HINT_NAMES:
        if name.lower() == wanted.lower():
            return name
    raise ValueError(
        f"unknown RRFP schedule {schedule_name!r}: use 'RRFP' (the {DEFAULT_HINT} hint) or one of "
        f"{[f'{PREFIX}-{n}' for n in HINT_NAMES]}"
    )


def schedule_class_of(schedule_name: str) -> type | None:
    """The class an RRFP schedule name stands for (None for other schedule names):
    ``ScheduleRRFPSingleStage`` for a hint with one stage per rank, else ``ScheduleRRFP``."""
    hint = hint_of(schedule_name)
    if hint is None:
        return None
    return ScheduleRRFPSingleStage if hint in _SINGLE_STAGE_HINTS else ScheduleRRFP


def register_with_torch() -> None:
    """Make torch's ``get_schedule_class`` accept the RRFP names (idempotent), other names
    going to torch's own. torchtitan looks schedule names up there: its main branch
    refuses an unknown ``pipeline_parallel_schedule`` when a ``ParallelismConfig`` is made
    (importing ``get_schedule_class`` from torch's module at that moment), and torch keeps
    no registry of schedule names to add to."""
    torch_get_schedule_class = torch_schedules.get_schedule_class
    if getattr(torch_get_schedule_class, "knows_rrfp", False):
        return

    @functools.wraps(torch_get_schedule_class)
    def get_schedule_class(schedule_name: str):
        found = schedule_class_of(schedule_name)
        return torch_get_schedule_class(schedule_name) if found is None else found

    get_schedule_class.knows_rrfp = True  # type: ignore[attr-defined]
    torch_schedules.get_schedule_class = get_schedule_class


def placement_schedule(hint: str) -> str:
    """The torch schedule name whose stage placement (and stages per rank) the hint uses;
    the BF/BFW rules run on loop placements with 2 or more stages per rank."""
    if hint in RULE_NAMES:
        return rule_reference(hint, "loop", stages_per_rank=2).__name__.removeprefix("Schedule")
    return hint


def torch_view_name(schedule_name: str) -> str:
    """The schedule name torchtitan is shown where it decides by name: an RRFP name becomes
    its placement schedule's (torchtitan only treats "ZBVZeroBubble" as V-shaped when
    choosing the loss rank, so DualPipeV's placement is shown as that); others unchanged."""
    hint = hint_of(schedule_name)
    if hint is None:
        return schedule_name
    name = placement_schedule(hint)
    return "ZBVZeroBubble" if name in _V_HINTS else name


def _torch_view(job_config):
    """job_config with an RRFP schedule name replaced by ``torch_view_name``'s."""
    name = job_config.parallelism.pipeline_parallel_schedule
    if hint_of(name) is None:
        return job_config
    return dataclasses.replace(
        job_config, parallelism=dataclasses.replace(
            job_config.parallelism, pipeline_parallel_schedule=torch_view_name(name)))


def rrfp_settings(job_config) -> RRFPConfig:
    return getattr(job_config, "rrfp", None) or RRFPConfig()


def n_microbatches(job_config) -> int:
    return batch_settings(job_config.training, job_config.parallelism).microbatches


def stages_per_rank(job_config, n_layers: int) -> int:
    """Stages per rank as torchtitan's pipeline_llm computes them for the hint."""
    # torchtitan has no public function for it (0.3's private _get_pipeline_metadata needs a
    # built ParallelDims), and this check runs before anything is built.
    parallelism = job_config.parallelism
    hint = hint_of(parallelism.pipeline_parallel_schedule)
    single = hint in _SINGLE_STAGE_HINTS
    layers_per_stage = parallelism.pipeline_parallel_layers_per_stage
    if layers_per_stage is None:
        return 1 if single else 2
    stages = math.ceil((n_layers + parallelism.pipeline_parallel_first_stage_less_layers
                        + parallelism.pipeline_parallel_last_stage_less_layers) / layers_per_stage)
    return max(1, stages // parallelism.pipeline_parallel_degree)


def schedule_settings(settings: RRFPConfig) -> Settings:
    """ScheduleRRFP's ``Settings`` from the ``[rrfp]`` section, as written: the schedule
    checks them with the check ``validate`` runs (``rrfp.core.checks.check_settings``)."""
    return Settings(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(Settings)
                       if hasattr(settings, f.name)})


def validate(job_config, n_layers: int) -> None:
    """Check an RRFP schedule config before anything is built; ValueError says what to fix."""
    parallelism = job_config.parallelism
    hint = hint_of(parallelism.pipeline_parallel_schedule)
    if hint is None:
        return
    # CP's collectives run inside a stage's compute, and its group is not coordinated (the
    # TP and EP groups are: ``coordination_group``).
    if parallelism.context_parallel_degree > 1:
        raise ValueError(
            f"schedule {parallelism.pipeline_parallel_schedule!r} cannot run with "
            f"parallelism.context_parallel_degree={parallelism.context_parallel_degree}: "
            "its collectives run inside each stage's compute, and RRFP coordinates only the "
            "tensor and expert parallel groups, so the ranks of a context parallel group could "
            "run their actions in different orders (mismatched collectives hang or give wrong "
            "results); set parallelism.context_parallel_degree = 1, or use torch's fixed "
            f"schedule pipeline_parallel_schedule = {placement_schedule(hint)!r}")
    pp = parallelism.pipeline_parallel_degree
    if pp < 2:
        raise ValueError(f"schedule {parallelism.pipeline_parallel_schedule!r} needs "
                         f"parallelism.pipeline_parallel_degree >= 2, got {pp}")
    per_rank = stages_per_rank(job_config, n_layers)
    if hint in _SINGLE_STAGE_HINTS and per_rank != 1:
        raise ValueError(f"hint {hint!r} runs one stage per rank, but "
                         f"pipeline_parallel_layers_per_stage gives {per_rank} per rank")
    layout = "v" if placement_schedule(hint) in _V_HINTS else "loop"
    batch = batch_settings(job_config.training, parallelism)
    microbatches = batch.microbatches
    try:
        built = build_hint(hint, num_ranks=pp, num_stages=pp * per_rank,
                           n_microbatches=microbatches, layout=layout)
    except ValueError as e:
        if "microbatches" not in str(e):
            raise
        raise ValueError(
            f"{e}; here microbatches = {batch.source}: {batch.remedy}") from None
    if microbatches < built.num_stages:
        from torchtitan.tools.logging import logger

        # What torchtitan warns for its own schedules, whose construction RRFP replaces.
        logger.warning(
            f"Number of microbatches ({microbatches}) is less than the total number "
            f"of stages ({built.num_stages}) which may result in a bubble in the pipeline.")
    check_settings(rrfp_settings(job_config), built, device_type())


def device_type() -> str:
    """The type of device torchtitan puts the stages on (``torchtitan_ext.common.cpu.use_cpu``
    sets it to ``"cpu"`` on a machine without an accelerator)."""
    from torchtitan.tools import utils

    return utils.device_type


def check_settings(settings: RRFPConfig, hint: Hint, device_type: str) -> None:
    """ValueError naming the first ``rrfp`` setting that ScheduleRRFP would refuse over
    ``hint`` on ``device_type`` stages, or that is not of its field's type (TOML values are
    not converted), with what it accepts: ScheduleRRFP's own check, then the fields only
    torchtitan reads. Run here, a bad one stops before anything is built."""
    platform = platform_for(device_type)
    own = {"log_stats": lambda: a_flag(settings.log_stats, "log_stats"),
           "trace_folder": lambda: a_folder(settings.trace_folder),
           "advise": lambda: a_flag(settings.advise, "advise")}
    try:
        try:
            check_rrfp_settings(schedule_settings(settings), hint,
                                free_memory_known=platform.free_bytes is not None,
                                device=device_type)
        except ValueError as e:
            if not str(e).startswith("tune_within: "):
                raise
            raise ValueError(f"{e}{options_beside_budget(settings)}") from None
        for field_name, check in own.items():
            try:
                check()
            except ValueError as e:
                raise ValueError(f"{field_name}: {e}") from None
    except ValueError as e:
        raise ValueError(f"rrfp.{e}") from None


def options_beside_budget(settings: RRFPConfig) -> str:
    """After ``rrfp.core.checks`` refused ``tune_within``: where it refused it beside
    settings it chooses itself, the options that reset them (a job's config may set them,
    as the main job sets ``fixed_every``), as ``"; on the command line: --rrfp.fixed_every
    0"``; else empty (every other field passed the check)."""
    given = chosen_beside_budget(schedule_settings(settings), parse_policy(settings.policy))
    defaults = RRFPConfig()
    options = " ".join(f"--rrfp.{name} {getattr(defaults, name)!s}" if getattr(defaults, name)
                       != "" else f"--rrfp.{name} ''" for name in given)
    return f"; on the command line: {options}" if given else ""


def a_folder(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"trace_folder must be a folder (a string; empty: none), got {value!r}")
    return value


INTRA_STAGE_MESH_DIMS = ("tp", "ep", "etp")
"""torchtitan's mesh dimensions (0.2.2 and 0.3) whose collectives run inside a stage's
compute: tensor, expert and expert-tensor parallel. (The data-parallel ones, ``fsdp``,
``efsdp``, ``dp_replicate``, ``dp_shard``, reduce at fixed points; ``cp`` is refused.)"""


def intra_stage_ranks(stages) -> set[int]:
    """The global ranks of every intra-stage collective group the stages' DTensor
    parameters are placed on (``INTRA_STAGE_MESH_DIMS`` of their meshes), this rank's
    included."""
    ranks = {dist.get_rank()}
    for stage in stages:
        for p in stage.submod.parameters():
            if not isinstance(p, DTensor):
                continue
            mesh = p.device_mesh
            for name in set(mesh.mesh_dim_names or ()) & set(INTRA_STAGE_MESH_DIMS):
                ranks.update(mesh[name].mesh.flatten().tolist())
    return ranks


def connected_groups(rank_sets: list[set[int]]) -> list[tuple[int, ...]]:
    """The groups that ranks sharing an intra-stage collective group, directly or through
    others, form (e.g. TP {0,1}, {2,3} with EP {0,2}, {1,3}: one group {0,1,2,3}); sorted,
    each sorted."""
    groups: list[set[int]] = []
    for ranks in rank_sets:
        merged = set(ranks)
        for group in [g for g in groups if g & merged]:
            merged |= group
            groups.remove(group)
        groups.append(merged)
    return sorted(tuple(sorted(g)) for g in groups)


def coordination_group(stages) -> dist.ProcessGroup | None:
    """One gloo group over every rank this rank shares a TP, EP or EP x TP group with
    (read off the stages' DTensor meshes), or None if it shares none.

    Every rank's ranks are all-gathered and one group created per connected set (a union
    of TP and EP groups is no group torchtitan has), in the same order on every rank (every
    rank builds its schedule at the same point of torchtitan's start-up). Gloo, so that
    creating it connects no device communicator; ScheduleRRFP agrees over its own twin.
    """
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, intra_stage_ranks(stages))
    mine = None
    for ranks in connected_groups(everyone):
        if len(ranks) == 1:
            continue
        created = dist.new_group(list(ranks), backend="gloo")
        if dist.get_rank() in ranks:
            mine = created
    return mine


def build_schedule(schedule_name: str, settings: RRFPConfig, stages, n_microbatches: int,
                   loss_fn) -> ScheduleRRFP:
    """ScheduleRRFP over torchtitan's ``stages`` for an RRFP schedule name, with the
    ``rrfp`` settings; torchtitan backpropagates the sum of the microbatches' losses
    (``scale_grads=False``), as for its own schedules. Logs what it built."""
    schedule = ScheduleRRFP(
        stages, n_microbatches, loss_fn=loss_fn, scale_grads=False,
        hint=hint_of(schedule_name), coordination_group=coordination_group(stages),
        settings=schedule_settings(settings),
    )
    from torchtitan.tools.logging import logger

    tuned = ("" if settings.tune_within in (None, "") else
             f", self-driving within {settings.tune_within!r} (rrfp.tune_within: it chooses "
             "the limit" + (", policy and interchangeable hint" if settings.tune_hints
                            else " and policy") + " from the run's first steps on)")
    logger.info(
        f"Using pipeline schedule {schedule_name}: ScheduleRRFP with hint {schedule.hint.name} "
        f"({schedule.hint.layout} placement), policy {schedule.policy}, buffer limit "
        f"{settings.buffer_limit!r} (rrfp.buffer_limit){tuned}, launch depth "
        f"{schedule.launch_depth}, {counted(n_microbatches, 'microbatch')}")
    # (What the limit allows: rrfp.schedule's line.)
    return schedule


def close_schedule(schedule) -> None:
    """At the trainer's close (both versions): a ScheduleRRFP's own ``close``, so that its
    threads stop and its channels' groups are destroyed before torchtitan's teardown and
    torch's ``destroy_process_group``, not whenever the interpreter frees them at exit
    (gloo's I/O thread would serve their connections while the process exits). Raises
    what ``close`` raises (a send of the last step that failed or did not complete)."""
    if isinstance(schedule, ScheduleRRFP):
        schedule.close()
        from torchtitan.tools.logging import logger

        logger.info("rrfp: closed the pipeline schedule (threads stopped, channels released)")
