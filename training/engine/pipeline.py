"""The transformer as a DeepSpeed ``PipelineModule``, trained with DeepSpeed's 1F1B schedule.

Layers, in order (each built only on the stage that owns it; their stage I/O and the layers
themselves in ``training/engine/pipe_layers.py``)::

    EmbeddingPipe                      token ids (B, S)          -> (hidden, aux_sum, z_sum[, docs][, ids])
    BlockPipe x num_layers             (hidden, aux_sum, z_sum[, docs][, ids]) -> the same
    [embedding again, embed_ahead      ids -> the embeddings of the tokens 1..D ahead     (MTP)
     MTPPipe]                          -> the D depths' normalized outputs               (MTP)
    HeadPipe (norm + lm_head)          -> (logits, aux_sum, z_sum[, docs, depth logits])
      or, with tied embeddings, FinalNormPipe + the embedding again (``TiedLayerSpec``)

Document masking (``model.document_separator_id``): only the first stage sees the token ids, so
it derives each token's document id, (B, S) int32 (this ep rank's rows; the whole sequence, also
under sequence parallelism), and the stages carry it with the hidden state; each block builds its
RoPE positions and attention mask from it (``attention_inputs``). Integer stage outputs get no
gradient in DeepSpeed's schedule; without masking or MTP the stage I/O is the three tensors.

Multi-token prediction (``model.mtp_depth`` D > 0, ``model/mtp.py``): the depths sit on the last
stage after its blocks. They need the token ids there (the first stage adds them to the stage
I/O, (B, S) integers like the document ids) and the embedding: the embedding is then a
``TiedLayerSpec`` also without tied embeddings, its copy on the last stage embedding the tokens
ahead (DeepSpeed sums the two copies' gradients, as for a tied head). ``PipelineLoss`` adds the
depths' objective, their MoE blocks add to the carried router sums after the model's, and the
statistics get each depth's cross-entropy, as ``Transformer.forward`` and the trainer do.

Blocks are spread evenly over the stages (``partition_method="type:BlockPipe"``, as Megatron's
``type:transformer``); the embedding rides with the first stage, the head with the last.

How the MoE auxiliary losses reach the loss: the stage I/O carries two fp32 scalars, the running
sums over MoE layers of the load-balancing loss and of the z-loss. Each MoE block adds its layer's
values (still in the autograd graph), the tensors cross stages like the hidden state, and the
last stage's ``PipelineLoss`` turns them into the router loss. DeepSpeed sends back a gradient
for every floating-point input of a stage and asserts that it exists, so both sums are always in
the graph: the embedding creates them as zeros derived from its output, and the loss uses them
even for dense models (times 0).

Exactness (the same objective as without a pipeline): without cp (cp = 1; below for cp > 1) the
non-pipeline trainer back-propagates, per micro-batch, ``(ce_sum + mtp) * dp / step_tokens +
router_loss / gas``. DeepSpeed's pipeline divides the last stage's
loss by the accumulation steps (``engine.backward`` with ``scale_wrt_gas=True``) and averages
gradients over data-parallel ranks, so ``PipelineLoss`` returns
``(ce_sum + mtp) * (dp * gas / step_tokens) + router_loss``: the same gradient, up to fp32 summation
order (DeepSpeed back-propagates each stage output separately, so a parameter's gradient on an
earlier stage is summed in another order; tests/parallel/test_train_layouts.py holds 1e-4).
Under fp32 ZeRO-0, gradients are clipped with the trainer's norm (``clip_fp32_with_norm``).

Context parallelism (cp > 1, docs/context-parallelism.md): the first stage gets the whole
(B, S) window, derives the document ids on it and embeds its ``split_for_cp`` slice; the
hidden state between stages is the rank's S/cp tokens while the document and MTP token ids
stay whole-window; each block takes the cp RoPE positions and masks (``rank_attention_inputs``),
the MTP embeddings and targets are shifted on the whole window and then sliced, and
``PipelineLoss`` slices the labels. cp sits between ep and dp in the rank order, so the
topology's 'data' axis is dp x cp and the pipeline engine averages over it, as the non-pipeline
engine does through the mpu; ``dp`` above then reads dp x cp, and the router loss is
multiplied by cp, as in the stepper.

Statistics: the loss and every MoE layer stash detached per-micro-batch values on this rank;
``TransformerPipe.add_step_stats`` fills the trainer's statistics vector, which the trainer sums
over the batch group and the pipeline group (each value lives on exactly one stage). With
loss-free balancing every stage then holds every layer's routed counts of the step and updates
its own layers' expert biases from them (``TransformerPipe.update_expert_bias``).

Pipeline x tensor/expert parallelism (3D layouts): every stage is built with this rank's
``ParallelGroups``, so its layers shard and communicate over tp and ep exactly as in the
``Transformer``; DeepSpeed's topology puts tp x ep on its 'model' axis (same rank order).
Under expert parallelism the first stage embeds, and the last stage scores, only this ep rank's
rows of each micro-batch (``expert_parallel_rows``, as ``Transformer.forward``); the carried loss
sums are then this rank's contributions, which sum over ep as in the non-pipeline trainer
(``MoEAux``). Under sequence parallelism each tp rank sends its (B, S/tp, H) shard of the
hidden state to its peer on the next stage (the embedding scatters, the head gathers), and the
blocks take the RoPE length from ``sequence_length``.
DeepSpeed's default of cutting the stage output over the 'model' axis for the send
(``pipe_partitioned``) is switched off (``pipeline_ds_config``). Gradient norm: DeepSpeed's
ZeRO-1 norm (grid as mpu) counts a gradient when its parameter is marked
``tensor_model_parallel`` or the rank's 'model' coordinate is 0, skips ``ds_pipe_replicated``
tied copies and sums over the data axis (dp x cp) and pipe x model: with our marking, every shard once.
Proven against the single-process control in tests/parallel/test_pipeline_layouts.py.
"""

from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from model.config import TransformerConfig
from model.mtp import depth_targets
from model.parallel.cp_layout import cp_slice
from model.parallel.groups import ParallelGroups
from model.parallel.grad_sync import ReplicaGradSync
from model.parallel.layers import cross_entropy_sum
from model.transformer import IGNORE_INDEX, expert_parallel_rows
from training.engine.pipe_layers import (BlockPipe, EmbeddingPipe, FinalNormPipe, HeadPipe, MTPPipe,
                                         embed_ahead, split_io, unembed)


class PipelineLoss:
    """``loss_fn`` of the last stage: the trainer's objective for one micro-batch.

    Returns ``(ce_sum + mtp) * ce_scale + cp * router_loss``, ``ce_scale = dp * cp * gas / step_tokens``
    (set by the trainer, see the module docstring), ``mtp`` the MTP depths' objective
    (``Transformer.mtp_objective``: ``mtp_loss_coef / D`` x their cross-entropy sums, targets from
    ``depth_targets``), and keeps ``[ce_sum, target_tokens, loss, depth ce sums..., depth
    targets...]`` per micro-batch (detached) for the statistics.
    """

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups):
        self.cfg, self.moe, self.num_moe_layers = cfg, cfg.moe, cfg.num_moe_layers
        self.groups = groups
        self.vocab_start = groups.tp_rank * cfg.vocab_size // groups.tp
        self.ce_scale: float | None = None
        self.records: list[torch.Tensor] = []

    def _ce(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(logits, targets, self.groups, self.vocab_start, IGNORE_INDEX)

    def __call__(self, outputs, labels: torch.Tensor) -> torch.Tensor:
        logits, aux_sum, z_sum, docs, depth_logits = split_io(self.cfg, outputs)
        window = expert_parallel_rows(labels, self.groups)      # the rows EmbeddingPipe kept on this rank
        labels = cp_slice(window, self.groups)                  # (B, S/cp): this cp rank's tokens
        ce_sum = self._ce(logits, labels)
        if self.moe is None:          # keep the carried sums in the graph (see module docstring)
            router = 0.0 * (aux_sum + z_sum)
        else:     # means over MoE layers, as Transformer.router_loss; x cp, as the stepper does
            router = self.groups.cp * (self.moe.aux_loss_coef * (aux_sum / self.num_moe_layers)
                                       + self.moe.z_loss_coef * (z_sum / self.num_moe_layers))
        # MTP targets on the whole window (the docs are whole-window), then this cp rank's slice.
        targets = [cp_slice(depth_targets(window, k, docs[0] if docs else None), self.groups)
                   for k in range(1, len(depth_logits) + 1)]
        depth_ce = [self._ce(lg, t) for lg, t in zip(depth_logits, targets)]
        mtp = self.cfg.mtp_loss_coef / len(depth_ce) * torch.stack(depth_ce).sum() if depth_ce else 0.0
        loss = (ce_sum + mtp) * self.ce_scale + router
        record = [ce_sum.detach().double(), (labels != IGNORE_INDEX).sum().double(), loss.detach().double()]
        record += [c.detach().double() for c in depth_ce]
        record += [(t != IGNORE_INDEX).sum().double() for t in targets]
        self.records.append(torch.stack(record))
        return loss


class TransformerPipe(PipelineModule):
    """The pipeline form of ``model.Transformer`` (see the module docstring).

    Args:
        cfg: the model config.
        groups: this rank's process groups; pipeline x data (x tp x ep) in the rank order of
            ``model/parallel/groups.py``, which is DeepSpeed's ``PipeModelDataParallelTopology``.
        seed: weight-init seed (the same full weights as ``Transformer(cfg, init_seed=seed)``).
        checkpointing: ``train.activation_checkpointing`` policy.
        init: optional full state dict (``--init-from``), keyed as the Transformer's.
    """

    def __init__(self, cfg: TransformerConfig, groups: ParallelGroups, seed: int,
                 checkpointing: str = "none", init: dict | None = None):
        args = (cfg, groups, seed)

        def tied_embedding(**forward):            # one weight on the first and the last stage
            return TiedLayerSpec("embed", EmbeddingPipe, *args, init=init,
                                 tied_weight_attr=["embed_tokens.weight"], **forward)
        tied = cfg.tie_embeddings or cfg.mtp_depth > 0
        layers = [tied_embedding() if tied else LayerSpec(EmbeddingPipe, *args, init=init)]
        layers += [LayerSpec(BlockPipe, cfg, i, groups, seed, checkpointing, init=init)
                   for i in range(cfg.num_layers)]
        if cfg.mtp_depth:       # the MTP depths on the last stage, before the final norm
            layers += [tied_embedding(forward_fn=embed_ahead),
                       LayerSpec(MTPPipe, *args, checkpointing, init=init)]
        if cfg.tie_embeddings:
            layers += [LayerSpec(FinalNormPipe, *args, init=init), tied_embedding(forward_fn=unembed)]
        else:
            layers.append(LayerSpec(HeadPipe, *args, init=init))
        # cp sits between ep and dp in the rank order, so dp x cp is the topology's 'data' axis
        # (coordinate dp_rank * cp + cp_rank): the pipeline engine averages over dp x cp.
        topology = PipeModelDataParallelTopology(num_pp=groups.pp, num_mp=groups.tp * groups.ep,
                                                 num_dp=groups.dp * groups.cp)
        super().__init__(layers=layers, topology=topology, loss_fn=PipelineLoss(cfg, groups),
                         partition_method="type:BlockPipe")
        coord = topology.get_coord(self.global_rank)
        assert (coord.pipe, coord.data, coord.model) == (groups.pp_rank, groups.get_data_parallel_rank(),
                                                         groups.mp_rank), "rank layouts differ"
        self.cfg = cfg
        # Replicated parameters' gradients summed over tp/ep per parameter in each backward (the
        # pipeline engine runs backward per micro-batch outside the trainer's loop).
        self.grad_sync = ReplicaGradSync(self, groups)

    def _moe_holders(self) -> list:
        """This stage's layers that hold MoE blocks: ``BlockPipe``s and ``MTPPipe``."""
        return [m for m in self.forward_funcs if isinstance(m, (BlockPipe, MTPPipe))]

    def reset_stats(self) -> None:
        """Forget the stashed per-micro-batch values (before each step and evaluation)."""
        self.loss_fn.records.clear()
        for layer in self._moe_holders():
            layer.moe_stats.clear()

    def add_step_stats(self, stats: torch.Tensor, gas: int, layout) -> None:
        """Add this rank's values to the trainer's statistics vector (``layout``, a
        ``training.step.stats.StatsLayout``): router values as means over micro-batches, the
        scalars also over MoE layers, as ``StatsLayout.add_micro_batch``; the MTP depths'
        cross-entropy sums and targets. Device-side adds only: no communication, no host copy."""
        for record in self.loss_fn.records:          # (ce_sum, target tokens, loss, mtp...)
            stats[0] += record[0]
            stats[1] += record[1]
            stats[2] += (~torch.isfinite(record[2])).double()
            if record.numel() > 3:
                stats[layout.mtp] += record[3:]
        if self.cfg.moe is None:
            return
        layers = self.cfg.num_moe_layers
        for layer in self._moe_holders():
            for row, (aux, z, entropy, dropped, counts, logit_max, logit_lse) in layer.moe_stats:
                for i, value in enumerate((aux, z, entropy, dropped)):
                    stats[3 + i] += value.double() / layers / gas
                layout.add_layer(stats, row, counts, entropy, dropped, logit_max, logit_lse, gas)

    def _moe_blocks(self) -> list:
        return [pair for layer in self._moe_holders() for pair in layer.moe_blocks()]

    def expert_biases(self) -> list[tuple[int, torch.Tensor]]:
        """(MoE layer index, expert bias) of this stage's routers that hold one."""
        return [(row, block.mlp.gate.e_score_correction_bias) for row, block in self._moe_blocks()
                if block.mlp.gate.e_score_correction_bias is not None]

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor) -> None:
        """Loss-free balancing on this stage: each of its MoE blocks updates its router's bias
        from its row of ``counts`` (L_moe, E), the step's counts of every MoE layer summed over
        the batch group and the stages (``Transformer.update_expert_bias``)."""
        for row, block in self._moe_blocks():
            block.mlp.gate.update_bias(counts[row])

    def eval_sums(self) -> torch.Tensor:
        """``[ce_sum, target_tokens]`` of the stashed micro-batches (zeros off the last stage)."""
        sums = torch.zeros(2, dtype=torch.float64)
        for record in self.loss_fn.records:
            sums += record[:2].cpu()
        return sums


def before_optimizer_step(engine, fn) -> None:
    """Call ``fn()`` inside every ``engine.train_batch``, after the last backward and the
    gradient reductions, before clipping and the optimizer step (on every rank).

    ``train_batch`` runs the whole step, so this is where the trainer takes the step's loss, its
    skip decision (lr 0) and, at ZeRO-0 fp32, the gradient norm before clipping -- what the
    non-pipeline trainer does between its last backward and ``engine.step()``. It wraps the
    engine's ``_take_model_step`` (DeepSpeed 0.19.8's PipelineEngine calls it from its
    OptimizerStep instruction).
    """
    take_step = engine._take_model_step

    def hooked(*args, **kwargs):
        fn()
        return take_step(*args, **kwargs)
    engine._take_model_step = hooked


def pipeline_ds_config(ds: dict) -> dict:
    """The DeepSpeed JSON for the pipeline engine: stage outputs and input gradients are sent
    whole between stages.

    With a 'model' axis (tp x ep > 1), DeepSpeed 0.19.8 defaults to ``pipeline.pipe_partitioned``
    and ``grad_partitioned``: it cuts the first stage output (and the gradient sent back) into
    1/(tp*ep) pieces, sends one piece per 'model' rank and all-gathers them over the 'model'
    axis on the other stage. That assumes the tensor is the same on every 'model' rank: true
    over tp, false over ep (each ep rank holds other tokens, so the gathered tensor would mix
    them). It also asserts that no other stage output requires grad, and our carried loss sums
    do. Both flags are forced off (a JSON that sets them on is overridden).
    """
    return {**ds, "pipeline": {**ds.get("pipeline", {}), "pipe_partitioned": False,
                               "grad_partitioned": False}}


def clip_fp32_with_norm(engine, norm_fn) -> None:
    """Make the engine's fp32 ZeRO-0 gradient clipping use ``norm_fn()``, the trainer's norm.

    DeepSpeed 0.19.8 clips fp32 ZeRO-0 gradients with ``runtime/utils.clip_grad_norm_``, which
    ignores ``ds_pipe_replicated``: a tied weight counts once per stage that holds it, so with
    tied embeddings it clips steps whose true norm is below the threshold (measured: a tiny
    Mixtral with norm 0.87 clipped at step 3). Same rule, ``min(1, clip / (norm + 1e-6))``, with
    the norm that counts every weight once; ``norm_fn()`` returns None on a skipped step (grads
    zeroed). Its ZeRO-1 and bf16 optimizers count tied weights once already.
    """
    max_norm = engine.gradient_clipping()

    def clip():
        norm = norm_fn()
        if norm is None or max_norm <= 0:
            return
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for p in engine.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
    engine.clip_fp32_gradients = clip
