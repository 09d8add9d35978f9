# Adapted from PyTorch's test/distributed/pipelining/test_schedule.py
# (https://github.com/pytorch/pytorch, BSD-3-Clause; Copyright (c) Meta Platforms, Inc. and
# affiliates) at commit e04e016e07271587550099c65d62c2512f93c142 (read from the public fork
# anagnorisis2peripeteia/pytorch at that commit; the file at torch 2.13.0's own commit was
# not available, and every torch API it uses exists in torch 2.13).
# Changed (the models, inputs, assertions and tolerances are torch's):
# * Only the tests that run a schedule object are kept: ScheduleTest's
#   test_schedule_with_single_stage, test_schedule_eval_then_train and
#   test_zero_bubble_schedule_errors_with_compile, and TestScheduleLowering's
#   test_grad_with_v_schedule and test_grad_with_split_b_w (whose accelerator-backend
#   decorator is gone: they use torch's fake process group and a CPU device). The tests of
#   torch's order generators, lowering passes, CSV artifacts and validation functions do
#   not involve a schedule object to substitute.
# * Every case runs twice (``harness.RUNTIMES``): each line that builds a schedule calls
#   ``self.under_test(<torch class>)(...)``, torch's class itself or ScheduleRRFP with that
#   class as hint (for ``_PipelineScheduleRuntime``, which the test then loads with actions:
#   the placement's default hint, replaced by those actions), with the same arguments.
# * ``@parametrize`` became the ``harness.cases`` lists below (same values); the cases run
#   in the test process, as torch's do, through ``harness.run_here``, which also ends a
#   process group a failed case left initialized; ``check_leaked_tensors`` comes from
#   ``harness``; ``device`` is the CPU (torch: the accelerator if any).
# * Cases that fail with torch's own class on CPU as well, or that ScheduleRRFP cannot
#   pass, are expected failures with their reason (``EXPECTED_FAILURES``;
#   docs/guide/limitations.md); the cases not in ``QUICK`` are marked ``torch_suite``, left out
#   of the default run and run by ``.ci/run``.
"""torch's single-process schedule tests, with torch's classes and with ScheduleRRFP."""

import copy

import pytest
import torch
from torch._dynamo import OptimizedModule
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    _Action,
    _PipelineScheduleRuntime,
    PipelineScheduleSingle,
)
from torch.distributed.pipelining.stage import PipelineStage
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.torch_adapted import harness
from tests.torch_adapted.harness import check_leaked_tensors, RankCase
from tests.torch_adapted.model_registry import MultiMLP

device = "cpu"


class ScheduleTest(RankCase):
    def test_schedule_with_single_stage(self, ScheduleClass):
        """
        Test that schedules with only a single stage work as expected for all schedules.
        """
        store = FakeStore()
        torch.distributed.init_process_group(
            backend="fake", rank=0, world_size=1, store=store
        )
        d_hid, batch_size = 512, 256
        n_stages = 1
        device = "cpu"
        full_mod = MultiMLP(d_hid, n_layers=n_stages)
        full_mod.to(device)

        x = torch.randn(batch_size, d_hid, device=device)
        ref_mod = copy.deepcopy(full_mod)
        with torch.no_grad():
            y = ref_mod(x)
            # Add a small perturbation
            target = y + torch.randn(batch_size, d_hid, device=device)

        def loss_fn(y, target):
            return torch.nn.functional.cross_entropy(y, target)

        # Run reference
        for _ in range(2):
            ref_mod.zero_grad()
            ref_out = ref_mod(x)
            ref_loss = loss_fn(ref_out, target)
            ref_loss.backward()

        submod_name = "layers.0"
        stage_module = full_mod.get_submodule(submod_name)

        # Create a pipeline stage to wrap that submodule
        num_microbatches = 2
        stages = [
            PipelineStage(
                stage_module,
                0,
                n_stages,
                device,
            )
        ]

        if issubclass(ScheduleClass, PipelineScheduleSingle):
            stages = stages[0]

        # Attach to a schedule
        schedule = self.under_test(ScheduleClass)(
            stages,
            num_microbatches,
            loss_fn=loss_fn,
        )
        # Run
        for _ in range(2):
            # Zero gradients
            stage_module.zero_grad()
            losses = []
            out = schedule.step(x, target=target, losses=losses)

        # Check output
        torch.testing.assert_close(out, ref_out)
        # Check loss
        # Since the reduction used in the loss function above is "mean", we use
        # "mean" here to reduce microbatch losses into a single value too.
        pipe_loss = torch.stack(losses).mean()
        torch.testing.assert_close(pipe_loss, ref_loss)

        # Check gradients
        # Get corresponding submodule from reference model
        ref_submod = ref_mod.get_submodule(submod_name)
        # Check gradients per parameter
        for name, p in stage_module.named_parameters():
            ref_p = ref_submod.get_parameter(name)
            try:
                torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-5, atol=4e-5)
            except AssertionError:
                print(f"Gradient test failed for {name}: {p.grad} vs {ref_p.grad}")
                raise

        torch.distributed.destroy_process_group()

    def test_schedule_eval_then_train(self, ScheduleClass):
        """
        Test that simply runs evaluation followed by training.
        """
        store = FakeStore()
        torch.distributed.init_process_group(
            backend="fake", rank=0, world_size=1, store=store
        )
        d_hid, batch_size = 512, 256
        n_stages = 1
        device = "cpu"
        full_mod = MultiMLP(d_hid, n_layers=n_stages)
        full_mod.to(device)

        x = torch.randn(batch_size, d_hid, device=device)
        target = torch.randn(batch_size, d_hid, device=device)

        def loss_fn(y, target):
            return torch.nn.functional.cross_entropy(y, target)

        submod_name = "layers.0"
        stage_module = full_mod.get_submodule(submod_name)

        # Create a pipeline stage to wrap that submodule
        num_microbatches = 2
        stages = [PipelineStage(stage_module, 0, n_stages, device)]

        if issubclass(ScheduleClass, PipelineScheduleSingle):
            stages = stages[0]

        # Attach to a schedule
        schedule = self.under_test(ScheduleClass)(stages, num_microbatches, loss_fn=loss_fn)
        # Run eval
        for _ in range(2):
            # Zero gradients
            stage_module.zero_grad()
            losses = []
            schedule.eval(x, target=target, losses=losses)
        # Run training
        try:
            for _ in range(2):
                losses = []
                schedule.step(x, target=target, losses=losses)
        finally:
            torch.distributed.destroy_process_group()

    def test_zero_bubble_schedule_errors_with_compile(self, ScheduleClass):
        """
        Test that zero bubble schedules raise an error when used with torch.compile.
        """
        store = FakeStore()
        torch.distributed.init_process_group(
            backend="fake", rank=0, world_size=1, store=store
        )
        n_stages = 1
        device = torch.device("cpu")
        model = MultiMLP(8, n_layers=n_stages)
        # full_mod
        compiled_model = torch.compile(model)
        self.assertTrue(isinstance(compiled_model, OptimizedModule))
        stage = PipelineStage(
            compiled_model,
            0,
            n_stages,
            device,
        )
        try:
            with self.assertRaises(RuntimeError):
                self.under_test(ScheduleClass)([stage], 2)
        finally:
            torch.distributed.destroy_process_group()

    def _parse_actions(self, actions: list[str]) -> list[_Action]:
        return [_Action.from_str(s) for s in actions]

    def test_grad_with_v_schedule(self):
        """
        We have a special case for V schedules where 2 adjacent stages are on the same rank.
        E.g.
        rank0:  stage 0,                 stage3
        rank1:          stage 1, stage 2,

        The special case involves not using send/recv ops but directly passing tensors between colocated stages.

        This test runs on a single rank and just tests the 'stage1, stage2' portion for both F and B, comparing
        gradients to a reference model with 2 layers.
        """
        store = FakeStore()
        torch.distributed.init_process_group(
            backend="fake", rank=0, world_size=1, store=store
        )
        d_hid = 512
        batch_size = 256
        n_stages = 2
        full_mod = MultiMLP(d_hid, n_layers=n_stages)
        full_mod.to(device)

        ref_mod = copy.deepcopy(full_mod)
        x = torch.randn(batch_size, d_hid, device=device)
        with torch.no_grad():
            y = ref_mod(x)
            # Add a small perturbation
            target = y + torch.randn(batch_size, d_hid, device=device)

        loss_fn = torch.nn.MSELoss(reduction="sum")

        # Run reference
        for _ in range(2):
            ref_mod.zero_grad()
            ref_out = ref_mod(x)
            ref_loss = loss_fn(ref_out, target)
            ref_loss.backward()

        stage_indices = [0, 1]
        submod_names = [f"layers.{i}" for i in stage_indices]
        stage_modules = [
            full_mod.get_submodule(submod_name) for submod_name in submod_names
        ]
        # Create a pipeline stage to wrap that submodule
        num_microbatches = 2
        stages = [
            PipelineStage(
                stage_module,
                stage_idx,
                n_stages,
                device,
            )
            for stage_module, stage_idx in zip(stage_modules, stage_indices)
        ]

        # Attach to a schedule
        schedule = self.under_test(_PipelineScheduleRuntime)(
            stages,
            num_microbatches,
            loss_fn=loss_fn,
            scale_grads=False,
        )
        schedule._prepare_schedule_with_comms(
            {
                0: self._parse_actions(
                    [
                        "0F0",
                        "0F1",
                        "1F0",
                        "1F1",
                        "1B0",
                        "1B1",
                        "0B0",
                        "0B1",
                    ]
                ),
            },
            format="compute_comms",
        )

        # Run
        with check_leaked_tensors() as garbage_tensors:
            for _ in range(2):
                # Zero gradients
                for stage_module in stage_modules:
                    stage_module.zero_grad()
                losses = []
                out = schedule.step(x, target=target, losses=losses)
        self.assertEqual(
            len(garbage_tensors),
            0,
            "Found leaked tensors, check logs above for debug info",
        )

        # Check output
        torch.testing.assert_close(out, ref_out)
        # Check loss
        # Since the reduction used in the loss function above is "sum", we use
        # "sum" here to reduce microbatch losses into a single value too.
        pipe_loss = sum(losses)
        torch.testing.assert_close(pipe_loss, ref_loss)

        # Check gradients
        for stage_module, submod_name in zip(stage_modules, submod_names):
            # Get corresponding submodule from reference model
            ref_submod = ref_mod.get_submodule(submod_name)
            # Check gradients per parameter
            for name, p in stage_module.named_parameters():
                ref_p = ref_submod.get_parameter(name)
                try:
                    torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-5, atol=4e-5)
                except AssertionError:
                    print(f"Gradient test failed for {name}: {p.grad} vs {ref_p.grad}")
                    raise

        torch.distributed.destroy_process_group()

    def test_grad_with_split_b_w(self):
        """
        Ensure that separate dInput and dWeight computations are correctly executed.
        This test runs on a single rank and just tests a single stage with 2 microbatches with separate B, W operations.
        """
        store = FakeStore()
        torch.distributed.init_process_group(
            backend="fake", rank=0, world_size=1, store=store
        )
        d_hid = 512
        batch_size = 256
        n_stages = 1
        full_mod = MultiMLP(d_hid, n_layers=n_stages)
        full_mod.to(device)

        ref_mod = copy.deepcopy(full_mod)
        x = torch.randn(batch_size, d_hid, device=device)
        with torch.no_grad():
            y = ref_mod(x)
            # Add a small perturbation
            target = y + torch.randn(batch_size, d_hid, device=device)

        loss_fn = torch.nn.MSELoss(reduction="sum")

        # Run reference
        for _ in range(2):
            ref_mod.zero_grad()
            ref_out = ref_mod(x)
            ref_loss = loss_fn(ref_out, target)
            ref_loss.backward()

        stage_indices = [0]
        submod_names = [f"layers.{i}" for i in stage_indices]
        stage_modules = [
            full_mod.get_submodule(submod_name) for submod_name in submod_names
        ]
        # Create a pipeline stage to wrap that submodule
        num_microbatches = 2
        stages = [
            PipelineStage(
                stage_module,
                stage_idx,
                n_stages,
                device,
            )
            for stage_module, stage_idx in zip(stage_modules, stage_indices)
        ]

        # Attach to a schedule
        schedule = self.under_test(_PipelineScheduleRuntime)(
            stages,
            num_microbatches,
            loss_fn=loss_fn,
            scale_grads=False,
        )
        schedule._prepare_schedule_with_comms(
            {
                0: self._parse_actions(
                    [
                        "0F0",
                        "0F1",
                        "0I0",
                        "0I1",
                        "0W0",
                        "0W1",
                    ]
                ),
            },
            format="compute_comms",
        )

        # Run
        with check_leaked_tensors() as garbage_tensors:
            for _ in range(2):
                # Zero gradients
                for stage_module in stage_modules:
                    stage_module.zero_grad()
                losses = []
                out = schedule.step(x, target=target, losses=losses)
        self.assertEqual(
            len(garbage_tensors),
            0,
            "Found leaked tensors, check logs above for debug info",
        )

        # Check output
        torch.testing.assert_close(out, ref_out)
        # Check loss
        # Since the reduction used in the loss function above is "sum", we use
        # "sum" here to reduce microbatch losses into a single value too.
        pipe_loss = sum(losses)
        torch.testing.assert_close(pipe_loss, ref_loss)

        # Check gradients
        for stage_module, submod_name in zip(stage_modules, submod_names):
            # Get corresponding submodule from reference model
            ref_submod = ref_mod.get_submodule(submod_name)
            # Check gradients per parameter
            for name, p in stage_module.named_parameters():
                ref_p = ref_submod.get_parameter(name)
                try:
                    torch.testing.assert_close(p.grad, ref_p.grad, rtol=1e-5, atol=4e-5)
                except AssertionError:
                    print(f"Gradient test failed for {name}: {p.grad} vs {ref_p.grad}")
                    raise

        torch.distributed.destroy_process_group()


ALL = [Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
       ScheduleLoopedBFS]
CASES = [
    *harness.cases("test_schedule_with_single_stage", ScheduleClass=ALL),
    *harness.cases("test_schedule_eval_then_train", ScheduleClass=ALL),
    *harness.cases("test_zero_bubble_schedule_errors_with_compile", ScheduleClass=[
        ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV]),
    *harness.cases("test_grad_with_v_schedule"),
    *harness.cases("test_grad_with_split_b_w"),
]
EXPECTED_FAILURES: dict[str, str] = {}
QUICK = {
    # stages built with a string device, one stage alone, torch's exception type,
    # actions given after construction (compute+comms format)
    *harness.ids("test_schedule_with_single_stage", "1F1B", "Interleaved1F1B"),
    *harness.ids("test_schedule_eval_then_train", "GPipe"),
    *harness.ids("test_zero_bubble_schedule_errors_with_compile", "ZBVZeroBubble"),
    *harness.ids("test_grad_with_split_b_w", ""),
}


@pytest.mark.parametrize("case", harness.params(CASES, EXPECTED_FAILURES, QUICK))
def test_torch(case):
    harness.run_here(ScheduleTest, case)
