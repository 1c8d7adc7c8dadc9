"""``train.compile``: ``torch.compile`` each transformer block on its own, before the engine
(``build.build_model`` applies it to the model it builds).

Per block, as torchtitan does: one graph per kind of block (a dense and an MoE block compile once
each, and every layer of a kind reuses that code), compile time that does not grow with depth,
and the embedding, the head, the losses and the trainer's statistics left eager (they hold the
ep row split, ``load_balancing_losses``'s all-reduce and the step's one host copy).

What is compiled is each block's ``forward``, in place (``torch.compile(block.forward)``), not
the module call: the module, its parameter names and its hooks stay where DeepSpeed, the
checkpoint shard maps and ``--init-from`` expect them, the hooks DeepSpeed puts on the block run
eagerly around the graph, and whole-block activation checkpointing (``full``, ``every_k``)
still wraps the block from outside. Under ZeRO-3 the block is also a ZeRO-3 leaf module
(``deepspeed.utils.set_z3_leaf_modules``): its hooks gather the whole block's parameters before
the graph runs and release them after, instead of hooks on every submodule, which would break
the graph at each of them and leave the weights that a block reads from its submodules
(``column_parallel_linears`` takes ``q_proj.weight`` ...) partitioned, empty, when traced. A
block is what ZeRO-3 holds whole at a time anyway (its MoE experts are one module).

DeepSpeed 0.19.8's ``engine.compile()`` does not serve this: it compiles the whole module as one
(``self.module.compile``), the losses and their collectives included; its DeepCompile passes need
that whole graph, and its per-region mode (``compile.autoep_non_moe``) applies only to
DeepSpeed's own AutoEP layers and refuses ZeRO-3 and pipelines. So the blocks are compiled here,
before ``deepspeed.initialize``, at every ZeRO stage and on pipeline stages alike.

Inside a block everything is one graph at ep 1, the MoE routing, dispatch and grouped GEMMs
included (``model/moe/experts.py`` and ``router.py`` hand the kernel choice and the jitter's
host seed to custom ops), at every ZeRO stage; under expert parallelism the exchange stays
eager (``MoELayer._routed_over_ep``: host split sizes) and the block compiles in pieces around
it. tests/model/test_compile.py counts the breaks. Shapes are static (``dynamic=False``): a run's
micro-batches have one shape; evaluation (no grad) compiles a graph of its own once, and another
shape recompiles instead of tracing symbolic sizes.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from model.transformer import Block, Transformer
from training.engine.sharded_build import builds_partitioned


def compile_blocks(model: nn.Module, enabled: bool, ds: dict | None = None) -> nn.Module:
    """When ``enabled`` (``train.compile``), compile the ``forward`` of every ``Block`` of
    ``model`` (a ``Transformer`` or a pipeline stage) in place, and under ZeRO-3 (``ds``, the
    run's DeepSpeed JSON) make each block a ZeRO-3 leaf; returns ``model``. Call it before
    ``deepspeed.initialize``, which registers the ZeRO-3 hooks. Lazy: each graph is traced at
    the first call of a block of its kind."""
    if not enabled:
        return model
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if not isinstance(model, Transformer):
        # A pipeline stage: DeepSpeed's PipelineEngine back-propagates each stage output on its
        # own, keeping the graph for the next (``retain_graph=True``), which a compiled
        # backward refuses when it reuses (donates) its saved buffers.
        torch._functorch.config.donated_buffer = False
    if builds_partitioned(ds):
        from deepspeed.utils import set_z3_leaf_modules
        set_z3_leaf_modules(model, [Block])
    for block in blocks:
        block.forward = torch.compile(block.forward, dynamic=False)
    return model
