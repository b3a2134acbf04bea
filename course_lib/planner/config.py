"""What the planner chooses: a ``Config``, one way to run a training step on each rank (chapter 13, sections 2-3).

Each field is a lever an earlier chapter explains: the precision (chapter 05's bf16 autocast, chapter 06's
FP8), the micro-batch and its accumulation steps (chapters 02-03), the checkpoint segments (chapter 05), the ZeRO
stage (chapter 09), the tensor-parallel size and sequence parallelism (chapter 10), fused attention, offloading and the loss in
chunks (chapter 11), the pipeline stages and their interleaving (chapter 08), the context-parallel and
expert-parallel sizes (chapter 12). ``pass_key`` names the forward/backward pass a configuration runs: ``measure``
measures one per precision and attention kernel, and ``predict`` reads its lines under that name.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """One way to run a training step on each rank."""

    precision: str          # "fp32", "bf16" autocast or "fp8" matmuls in the blocks (weights, gradients, optimizer
                            # state stay fp32)
    micro_batch: int
    accumulation_steps: int
    segments: int           # checkpoint segments over ``model.blocks``; 1 = no checkpointing
    zero_stage: int         # over the data-parallel ranks; 0 = plain data parallel (or one device)
    tp: int = 1             # tensor-parallel ranks sharing each block; the world / tp others are data-parallel
    sequence_parallel: bool = False  # with tp > 1: the LayerNorm regions cut along the sequence (chapter 10)
    fused: bool = False     # every CausalSelfAttention runs F.scaled_dot_product_attention (chapter 11), else op by op
    offload: bool = False   # what the blocks save waits in host memory until the backward pass (chapter 11)
    loss_chunks: int = 1    # the loss over the vocabulary in this many token chunks (chapter 11); 1 = whole
    cp: int = 1             # context-parallel ranks sharing each sequence: ring attention (chapter 12)
    ep: int = 1             # expert-parallel ranks sharing a mixture of experts' experts (chapter 12)
    pp: int = 1             # pipeline stages (chapter 08): the blocks cut into pp stages, the micro-batches run 1F1B
    virtual_stages: int = 1  # with pp > 1: model chunks per stage, interleaved 1F1B (chapter 08); 1 = plain 1F1B

    def __post_init__(self) -> None:
        if self.pp < 1 or self.virtual_stages < 1 or (self.virtual_stages > 1 and self.pp == 1):
            raise ValueError(f"pp and virtual_stages must be >= 1, and interleaving needs a pipeline (pp > 1); got "
                             f"pp={self.pp}, virtual_stages={self.virtual_stages}")
        if self.loss_chunks < 1:
            raise ValueError(f"loss_chunks must be >= 1, got {self.loss_chunks}")
        if self.offload and (self.segments > 1 or self.zero_stage == 3):
            raise ValueError("offload moves what the blocks save: not with checkpointing (which saves only the "
                             "segment inputs) nor with ZeRO-3, whose gathered weights the hooks would copy too")
        if self.tp > 1 and (self.fused or self.offload or self.loss_chunks > 1):
            raise ValueError("the course's tensor-parallel block (chapter 10) runs op-by-op attention, the whole "
                             "loss and no offload: use fused, offload and loss_chunks with tp = 1")

        if self.cp < 1 or self.ep < 1:
            raise ValueError(f"cp and ep must be >= 1, got {self.cp} and {self.ep}")
        if self.cp > 1 and (not self.fused or self.tp > 1 or self.segments > 1 or self.offload
                            or self.loss_chunks > 1):
            raise ValueError("the course's ring attention (chapter 12) saves what the fused kernel saves: plan cp > 1 "
                             "with fused=True, and without tensor parallelism, checkpointing, offload or loss chunks")

    @property
    def pass_key(self) -> str:
        """The measured forward/backward pass this runs: the keys of ``Measurements``' lines (``pass_key``)."""
        return pass_key(self.precision, self.fused)

    def describe(self) -> str:
        ckpt = "no checkpointing" if self.segments == 1 else f"checkpointing in {self.segments} segments"
        text = (f"{self.precision}, micro-batch {self.micro_batch} x {self.accumulation_steps} accumulation "
                f"steps, {ckpt}, ZeRO stage {self.zero_stage}")
        if self.pp > 1:
            text += f", pipeline over {self.pp} stages" + (f" of {self.virtual_stages} interleaved chunks"
                                                          if self.virtual_stages > 1 else " (1F1B)")
        if self.tp > 1:
            text += f", tensor parallel over {self.tp}"
            text += " with sequence parallelism" if self.sequence_parallel else ""
        if self.cp > 1:
            text += f", context parallel over {self.cp} (ring attention)"
        if self.ep > 1:
            text += f", experts over {self.ep} ranks"
        return ", ".join([text, *self.memory_options()])

    def memory_options(self) -> list[str]:
        """Chapter 11's options this configuration uses, in words."""
        return ((["fused attention"] if self.fused else [])
                + ([f"the loss in {self.loss_chunks} chunks"] if self.loss_chunks > 1 else [])
                + (["activations offloaded to the host"] if self.offload else []))


def pass_key(precision: str, fused: bool) -> str:
    """The name of a measured forward/backward pass: its precision, and " fused" for fused attention."""
    return precision + (" fused" if fused else "")
