"""torchtitan 0.3: the jobs of ``train_configs/*.toml`` as config functions.

    torchrun --nproc-per-node 2 -m torchtitan.train --module torchtitan_ext --config rrfp_llama3_debug_cpu

torchtitan's ``--module torchtitan_ext`` imports this module; ``--config <function>``
picks one of the functions below, each returning an ``RRFPTrainer.Config``; any field can
be overridden on the command line (``--training.steps 8``, ``--rrfp.buffer_limit hint+2``,
``--parallelism.pipeline_parallel_schedule RRFP-ZBVZeroBubble``). The ``rrfp`` fields
have the names and defaults of the ``[rrfp]`` TOML section (``torchtitan_ext.config``).
Importing this module reads no command line: ``torchtitan_ext.train`` names an unknown
``--rrfp.<name>`` with the nearest setting before torchtitan parses.

* ``rrfp_llama3_debug_cpu``: llama3 debugmodel, 2 pipeline ranks x 2 stages, RRFP with
  the Interleaved1F1B hint, on the generated arithmetic corpus (``train_configs/
  llama3_debug_cpu.toml``);
* ``rrfp_documents_cpu``: whole documents, each microbatch as long as its content
  (``rrfp.variable_shapes``);
* ``rrfp_multimodal_cpu``: documents with 0-40 image patches each, encoded on the first
  stage (``torchtitan_ext.titan_0_3.multimodal``), variable shapes;
* ``rrfp_deepseek_v3_ep_cpu``: deepseek_v3 debugmodel (mixture of experts), 2 pipeline
  ranks x 2 stages x expert parallel 2 on 4 processes (``train_configs/
  deepseek_v3_ep_cpu.toml``);
* ``rrfp_llama3_8b`` / ``rrfp_llama3_8b_zbv``: GPU starting points (PP 4 x TP 2 x FSDP,
  Interleaved1F1B hint; PP 4 x FSDP, ZBV hint). Not run by this project: they need the
  Llama 3.1 8B tokenizer in ``./assets/hf/Llama-3.1-8B`` and the c4 dataset;
* ``rrfp_deepseek_v3_16b``: GPU starting point, DeepSeek-V3 16B, PP 2 x EP 8 x FSDP 8 on
  16 GPUs (``train_configs/deepseek_v3_16b_rrfp.toml``). Not run by this project: it
  needs the DeepSeek-V3 tokenizer in ``./assets/hf/deepseek-moe-16b-base`` and c4.
"""

from __future__ import annotations

from torchtitan_ext.common.version import CONFIG_FN_INSTEAD, require

require((0, 3), "torchtitan_ext.config_registry", CONFIG_FN_INSTEAD)

from torchtitan.components.checkpoint import CheckpointManager  # noqa: E402
from torchtitan.components.loss import CrossEntropyLoss  # noqa: E402
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer  # noqa: E402
from torchtitan.components.validate import Validator  # noqa: E402
from torchtitan.config import ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.config.configs import DebugConfig  # noqa: E402
from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.common.config_utils import decoder_vocab_size  # noqa: E402
from torchtitan.models.deepseek_v3 import model_registry as deepseek_v3_registry  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

from torchtitan_ext.common.assets import DATASET_NAME, TOKENIZER_DIR  # noqa: E402
from torchtitan_ext.common.schedules import register_with_torch  # noqa: E402
from torchtitan_ext.config import RRFPConfig  # noqa: E402
from torchtitan_ext.titan_0_3.dataloaders import DocumentDataLoader  # noqa: E402
from torchtitan_ext.titan_0_3.multimodal import multimodal_registry  # noqa: E402
from torchtitan_ext.titan_0_3.trainer import RRFPMetricsProcessor, RRFPTrainer  # noqa: E402

# Before any config function makes a ParallelismConfig naming an RRFP schedule: torchtitan's
# main branch checks the name through torch's get_schedule_class there.
register_with_torch()

__all__ = ["rrfp_llama3_debug_cpu", "rrfp_documents_cpu", "rrfp_multimodal_cpu",
           "rrfp_deepseek_v3_ep_cpu", "rrfp_llama3_8b", "rrfp_llama3_8b_zbv",
           "rrfp_deepseek_v3_16b"]


def causal_sdpa(model_spec):
    """``model_spec`` with causal SDPA attention in every layer, for CPU jobs.

    torchtitan 0.3 builds language models with flex (or varlen) attention, block-causal
    over its packed documents, and refuses ``attn_backend="sdpa"`` by name; flex attention
    is compiled by inductor, minutes on a small CPU. The documents jobs hold one document
    per sample, where causal is exact; on the packed arithmetic corpus attention crosses
    document boundaries, as on torchtitan 0.2.2's sdpa."""
    for layer in model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return model_spec


def _cpu_job(model_spec, dump_folder: str, **training) -> RRFPTrainer.Config:
    """What the CPU jobs share, as in ``train_configs/llama3_debug_cpu.toml``."""
    return RRFPTrainer.Config(
        model_spec=model_spec,
        hf_assets_path=TOKENIZER_DIR,
        dump_folder=dump_folder,
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        optimizer=default_adamw(lr=3e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8,
                                                  min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=8, max_norm=1.0, steps=20,
                                mixed_precision_param="float32", disable_cuda_graphs=True,
                                **training),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=DATASET_NAME),
        metrics=RRFPMetricsProcessor.Config(log_freq=1, enable_tensorboard=True,
                                            save_tb_folder="tb"),
        parallelism=ParallelismConfig(pipeline_parallel_degree=2,
                                      pipeline_parallel_schedule="RRFP",
                                      pipeline_parallel_microbatch_size=1,
                                      data_parallel_shard_degree=1),
        rrfp=RRFPConfig(buffer_limit="hint", stall_timeout=300, log_stats=True,
                        trace_folder="traces"),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        # Off as in the TOML jobs; --validator.enable evaluates on the generated corpus
        # (the trainer's pre-split pp_schedule.eval(arg_mbs=...)).
        validator=Validator.Config(freq=5, steps=2, dataloader=HuggingFaceTextDataLoader.Config(
            dataset=DATASET_NAME, infinite=False)),
        debug=DebugConfig(seed=42),
    )


def rrfp_llama3_debug_cpu() -> RRFPTrainer.Config:
    """llama3 debugmodel, 2 pipeline ranks x 2 stages per rank, RRFP (the Interleaved1F1B
    hint, RRFP's recommended setting), on CPU; 20 steps on the arithmetic corpus, every
    second one in the fixed order (the in-run A/B), as ``train_configs/llama3_debug_cpu.toml``."""
    config = _cpu_job(causal_sdpa(model_registry("debugmodel")),
                      "./outputs/llama3_debug_cpu", seq_len=128)
    config.rrfp.fixed_every = 2
    return config


def rrfp_documents_cpu() -> RRFPTrainer.Config:
    """llama3 debugmodel on whole documents (34-102 tokens, not packed), each microbatch
    as long as its content rounded up to 16; RRFP with variable shapes, on CPU."""
    config = _cpu_job(causal_sdpa(model_registry("debugmodel")),
                      "./outputs/documents_cpu", seq_len=128)
    config.dataloader = DocumentDataLoader.Config()
    config.rrfp.variable_shapes = True
    return config


def rrfp_multimodal_cpu() -> RRFPTrainer.Config:
    """llama3 debugmodel whose first stage encodes 0-40 image patches per sample (taken
    from the document) before the language layers; RRFP with variable shapes, on CPU."""
    config = _cpu_job(causal_sdpa(multimodal_registry("debugmodel")), "./outputs/multimodal_cpu",
                      seq_len=176)
    config.dataloader = DocumentDataLoader.Config(images=True)
    config.rrfp.variable_shapes = True
    return config


def rrfp_deepseek_v3_ep_cpu() -> RRFPTrainer.Config:
    """deepseek_v3 debugmodel (8 experts, top 3), 2 pipeline ranks x 2 stages per rank x
    expert parallel 2 on 4 processes, RRFP, on CPU; as ``train_configs/
    deepseek_v3_ep_cpu.toml``.

    The EP ranks are data-parallel ranks (FSDP 2 on the dense layers). On CPU:
    ``partial_dtensor`` (the default ``spmd_types`` backend's list all-to-all, which gloo
    refuses for uneven splits, is not used), causal SDPA attention, and deterministic
    kernels (the MoE layers' CPU kernels are not deterministic otherwise: torch's fixed
    schedule differs from run to run, and RRFP is bitwise equal to it only with them)."""
    config = _cpu_job(causal_sdpa(deepseek_v3_registry("debugmodel")),
                      "./outputs/deepseek_v3_ep_cpu", seq_len=64)
    config.training.local_batch_size = 4
    config.training.steps = 10
    config.parallelism.data_parallel_shard_degree = 2
    config.parallelism.expert_parallel_degree = 2
    config.parallelism.spmd_backend = "partial_dtensor"
    config.debug.deterministic = True
    return config


def _gpu_starting_point(model_spec, *, hf_assets_path: str, dump_folder: str, optimizer,
                        lr_scheduler: LRSchedulersContainer.Config, training: TrainingConfig,
                        parallelism: ParallelismConfig) -> RRFPTrainer.Config:
    """What the GPU starting points share: c4, TensorBoard every 10 steps, selective
    activation checkpointing, a checkpoint every 500 steps, and RRFP at the hint's memory
    ("hint+2" trades memory for speed) with a stall timeout for large steps."""
    return RRFPTrainer.Config(
        model_spec=model_spec,
        hf_assets_path=hf_assets_path,
        dump_folder=dump_folder,
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec)),
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        training=training,
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        metrics=RRFPMetricsProcessor.Config(log_freq=10, enable_tensorboard=True),
        parallelism=parallelism,
        rrfp=RRFPConfig(buffer_limit="hint", stall_timeout=600, log_stats=True),
        activation_checkpoint=SelectiveAC.Config(),
        checkpoint=CheckpointManager.Config(enable=True, folder="checkpoint", interval=500),
    )


def rrfp_llama3_8b() -> RRFPTrainer.Config:
    """llama3 8B, RRFP (Interleaved1F1B hint) x TP 2 x FSDP on 8 or more GPUs (as
    ``train_configs/llama3_8b_rrfp.toml``). Not run by this project."""
    return _gpu_starting_point(
        model_registry("8B"),
        hf_assets_path="./assets/hf/Llama-3.1-8B",
        dump_folder="./outputs/llama3_8b_rrfp",
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=200),
        training=TrainingConfig(local_batch_size=16, seq_len=8192, max_norm=1.0, steps=1000,
                                disable_cuda_graphs=True),  # torchtitan: none with PP yet
        parallelism=ParallelismConfig(pipeline_parallel_degree=4,
                                      pipeline_parallel_schedule="RRFP",
                                      pipeline_parallel_microbatch_size=1,
                                      data_parallel_shard_degree=-1,
                                      tensor_parallel_degree=2),
    )


def rrfp_llama3_8b_zbv() -> RRFPTrainer.Config:
    """llama3 8B, RRFP with the ZBVZeroBubble hint (V placement) x FSDP, no TP (as
    ``train_configs/llama3_8b_rrfp_zbv.toml``). Not run by this project."""
    config = rrfp_llama3_8b()
    config.dump_folder = "./outputs/llama3_8b_rrfp_zbv"
    config.parallelism.pipeline_parallel_schedule = "RRFP-ZBVZeroBubble"
    config.parallelism.tensor_parallel_degree = 1
    return config


def rrfp_deepseek_v3_16b() -> RRFPTrainer.Config:
    """DeepSeek-V3 16B, RRFP (Interleaved1F1B hint) over 2 pipeline ranks x 2 stages, EP 8 x
    FSDP 8 inside each stage, on 16 GPUs (as ``train_configs/deepseek_v3_16b_rrfp.toml``).
    Not run by this project."""
    return _gpu_starting_point(
        deepseek_v3_registry("16B"),
        hf_assets_path="./assets/hf/deepseek-moe-16b-base",
        dump_folder="./outputs/deepseek_v3_16b_rrfp",
        optimizer=default_adamw(lr=2.2e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=100, decay_ratio=0.8,
                                                  decay_type="cosine", min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=8, seq_len=4096, max_norm=1.0, steps=1000,
                                disable_cuda_graphs=True),  # torchtitan: none with PP yet
        parallelism=ParallelismConfig(pipeline_parallel_degree=2,
                                      pipeline_parallel_schedule="RRFP",
                                      pipeline_parallel_microbatch_size=1,
                                      data_parallel_shard_degree=-1,
                                      expert_parallel_degree=8),
    )
