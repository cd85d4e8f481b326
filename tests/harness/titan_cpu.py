"""torchtitan 0.3's own ``Trainer`` built and trained on CPU, for the tests: what stands in, and why.

torchtitan is written for accelerators, and three things in 0.3.0 forbid a CPU run as shipped:

* ``torchtitan/tools/utils.py`` line 55: ``device_type = _get_available_device_type() or "cuda"``: with
  no accelerator visible the device is ``cuda``, and ``Trainer.__init__`` then calls
  ``torch.cuda.set_device`` (trainer.py line 301), which a CPU build of torch refuses; the metrics'
  ``DeviceMemoryMonitor`` and the peak-FLOPS lookup read the device module's properties and memory
  statistics, which ``torch.cpu`` lacks.
* the language models' inner attention (``FlexAttention``, models/common/attention.py) is
  ``torch.compile``-d with ``max_autotune`` at every call, and ``VarlenAttention`` is a CUDA kernel.
* the shipped debug configs read a tokenizer and a dataset from torchtitan's source tree
  (``./tests/assets``), which the wheel does not ship.

So :func:`use_cpu` (called before torchtitan's modules are imported) points ``tools.utils``'s device at
:class:`_CpuDevice` (``torch.cpu`` plus the few properties the metrics read); :func:`tiny_config` builds a
``Trainer.Config`` with torchtitan's llama3 model (its ``Decoder``, blocks, RoPE, fused QKV, FSDP2
through ``parallelize_llama``) at tiny sizes, whose inner attention is torchtitan's own
``ScaledDotProductAttention`` (causal, eager; what its Flux model uses), and a synthetic token stream (:class:`TokenStream`, a
Stateful ``IterableDataset`` read by torchtitan's own ``ParallelAwareDataloader``). Everything else the
trainer runs is torchtitan's: ``Trainer.__init__``, ``train_step``, ``OptimizersContainer``,
``LRSchedulersContainer``, the loss, gradient clipping, the ``CheckpointManager``.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch

_CPU: types.ModuleType | None = None


class _CpuDevice(types.ModuleType):
    """``torch.cpu`` with what torchtitan's metrics read from an accelerator's module."""

    def __init__(self) -> None:
        super().__init__("ckptless_tests_cpu_device")
        self.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu)
                              if not k.startswith("__") and k not in type(self).__dict__})

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=1 << 30, name="cpu")

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {"active_bytes.all.peak": 0, "active_bytes.all.current": 0, "reserved_bytes.all.peak": 0,
                "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def current_device() -> int:
        return 0


def use_cpu() -> None:
    """Point torchtitan's device at the CPU; before any other torchtitan module is imported (they bind
    ``device_type``/``device_module`` from ``tools.utils`` at their import)."""
    global _CPU
    import sys

    import torchtitan.tools.utils as tt_utils

    if _CPU is None:
        _CPU = _CpuDevice()
    was = tt_utils.device_module
    tt_utils.device_type, tt_utils.device_module = "cpu", _CPU
    # and in the torchtitan modules imported already (a test process may have imported some)
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan.") and module is not None and module is not tt_utils:
            if getattr(module, "device_module", None) is was:
                module.device_module = _CPU  # type: ignore[attr-defined]
            if isinstance(getattr(module, "device_type", None), str):
                module.device_type = "cpu"  # type: ignore[attr-defined]


def _classes() -> dict[str, Any]:
    """torchtitan's classes, imported after :func:`use_cpu`."""
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import BaseTokenizer

    class TokenStream(IterableDataset):
        """An endless seeded token stream for one data-parallel rank; Stateful (its position), as
        torchtitan's ``HuggingFaceTextDataset`` is, so the loader's state resumes it exactly."""

        def __init__(self, vocab: int, seq_len: int, dp_rank: int) -> None:
            self.vocab, self.seq_len, self.dp_rank, self.sample = vocab, seq_len, dp_rank, 0

        def __iter__(self) -> Any:
            while True:
                g = torch.Generator().manual_seed(1000 * self.dp_rank + self.sample)
                tokens = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
                self.sample += 1
                yield {"input": tokens[:-1]}, tokens[1:]

        def state_dict(self) -> dict[str, int]:
            return {"sample": self.sample}

        def load_state_dict(self, sd: dict[str, int]) -> None:
            self.sample = int(sd["sample"])

    class TokenStreamLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            vocab: int = 64

        def __init__(self, config: Config, *, dp_world_size: int, dp_rank: int, tokenizer: Any, seq_len: int,
                     local_batch_size: int, snapshot_every_n_steps: int | None = None) -> None:
            super().__init__(TokenStream(config.vocab, seq_len, dp_rank), dp_rank=dp_rank,
                             dp_world_size=dp_world_size, batch_size=local_batch_size,
                             num_workers=config.num_workers)

    class NoTokenizer(BaseTokenizer):
        """The token stream is tokens already: a tokenizer with nothing to read from disk."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab: int = 64

        def __init__(self, config: Config, *, tokenizer_path: str | None = None) -> None:
            super().__init__()
            self.vocab = config.vocab

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return self.vocab

    return {"TokenStreamLoader": TokenStreamLoader, "NoTokenizer": NoTokenizer}


def _sum_reductions(parallelize_fn: Any) -> Any:
    """``parallelize_fn``, then FSDP2's reductions as plain sums: torchtitan sets each FSDP module's
    gradient divide factor to 1.0 (it scales by the global token count itself), which FSDP2 reduces with
    ``PREMUL_SUM``, an NCCL op Gloo refuses; a sum times 1.0 is the same sum."""
    from torch.distributed.fsdp import FSDPModule

    def parallelize(*args: Any, **kwargs: Any) -> Any:
        model = parallelize_fn(*args, **kwargs)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
        return model

    return parallelize


def tiny_config(*, steps: int, dump_folder: str, vocab: int = 64, dim: int = 32, layers: int = 2,
                seq_len: int = 16, batch: int = 2, global_batch: int = -1, checkpoint_interval: int = 0,
                fuse_qkv: bool = True) -> Any:
    """A ``Trainer.Config``: torchtitan's llama3 at tiny sizes, FSDP2 over every rank (``dp_shard=-1``),
    float32 (Gloo reduces no bfloat16 on every build), no compile, no activation checkpointing, the
    ``partial_dtensor`` SPMD backend (0.3's default, ``spmd_types``, refuses to shard even its own
    ``debugmodel`` over 2 CPU ranks: "When dp_mesh_dims is provided, all parameters must be DTensors");
    ``checkpoint_interval`` > 0 keeps torchtitan's ``CheckpointManager`` on (the disk fallback)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config.configs import DebugConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, model_registry
    from torchtitan.trainer import Trainer

    c = _classes()
    heads = 4
    layer_cfgs = _build_llama3_layers(
        fuse_qkv=fuse_qkv, n_layers=layers, dim=dim, n_heads=heads,
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=16),
        rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=4 * seq_len, theta=10000, scaling="none"),
        attn_backend="flex")
    for layer in layer_cfgs:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    spec = model_registry("debugmodel")
    spec.parallelize_fn = _sum_reductions(spec.parallelize_fn)
    spec.model = Llama3Model.Config(
        dim=dim, vocab_size=vocab, layers=layer_cfgs,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=vocab))
    return Trainer.Config(
        model_spec=spec, dump_folder=dump_folder, hf_assets_path=dump_folder,
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),
        tokenizer=c["NoTokenizer"].Config(vocab=vocab),
        dataloader=c["TokenStreamLoader"].Config(vocab=vocab),
        optimizer=default_adamw(lr=1e-3),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.5, decay_type="linear",
                                                  min_lr_factor=0.1),
        training=TrainingConfig(local_batch_size=batch, global_batch_size=global_batch, seq_len=seq_len,
                                steps=steps, mixed_precision_param="float32", disable_cuda_graphs=True,
                                max_norm=1.0),
        metrics=MetricsProcessor.Config(log_freq=1),
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
        checkpoint=CheckpointManager.Config(enable=checkpoint_interval > 0, interval=max(checkpoint_interval, 1),
                                            folder="checkpoint"),
        activation_checkpoint=None, debug=DebugConfig(seed=0),
        validator=Validator.Config(enable=False))


def tiny_cpu() -> Any:
    """The config registry function of ``--module tests.harness.titan_cpu --config tiny_cpu`` (the
    examples/torchtitan_train.py runs of the tests): :func:`tiny_config` with 12 steps; torchtitan's
    command line overrides the rest (``--training.steps``, ``--dump_folder``, ``--checkpoint.interval``)."""
    return tiny_config(steps=12, dump_folder="./outputs")


def tiny_cpu_unfused() -> Any:
    """:func:`tiny_cpu` with separate ``wq``/``wk``/``wv`` (llama3's ``fuse_qkv=False``): the fused block's
    ``state_dict`` hook gathers each ``wqkv`` to Replicate (a collective in every ``state_dict()``), with
    ``allgather_into_tensor_coalesced``, which the NCCL stand-in's Gloo underneath lacks
    (tests/gpu/test_shared_gpu.py on CPU)."""
    return tiny_config(steps=12, dump_folder="./outputs", fuse_qkv=False)
