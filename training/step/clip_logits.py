"""The trainer's side of ``train.qk_clip_tau`` (QK-clip, ``model/qk_clip.py``; MuonClip with the
Muon JSON, and it works with AdamW too).

Each attention module records its heads' largest logit while the step's micro-batches run;
after the optimizer step ``QKClip.after_step`` puts every layer's heads into one (layers, heads)
tensor, takes the maximum over every rank in one all-reduce (each head's value lives on the tp
rank that holds it, each rank saw its own tokens, and a pipeline stage holds its own layers),
and on an applied step scales the query and key rows of the heads over tau, in the layers that
have one (the row's per-layer maxima, read to the host for the metrics, say which). The weights are
scaled where the step left them: the module's own tensor (the next forward's weights) and,
under DeepSpeed's mixed precision or ZeRO, this rank's part of the fp32 master copy, which the
next update starts from (ZeRO-1/2 and the bf16 optimizer: the parameter's ``_hp_mapping``
fragment; ZeRO-3: the local partition of both, and the gathered tensor of a parameter ZeRO-3 keeps
whole, ``stage3_param_persistence_threshold``). Optimizer states are left as they are, as in
Kimi K2. The row of ``metrics.jsonl`` gets ``max_logit``: each layer's largest logit of the
step, before the clip (MTP's blocks last); W&B gets ``max_logit/layer<i>``.
"""

from __future__ import annotations

import re

import torch

from model.parallel.whole_matrix import job_max, rank_in
from model.qk_clip import HeadLogits, clip_factors, row_scales

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_MTP = re.compile(r"(?:^|\.)mtp\.(\d+)\.")


def _slot(name: str, num_layers: int) -> int:
    """The layer position of an attention module: its block's index, or num_layers + k for MTP depth k."""
    m = _MTP.search(name)
    if m:
        return num_layers + int(m.group(1))
    return int(_LAYER.search(name).group(1))


class QKClip:
    """QK-clip at ``tau`` over ``model``'s attention modules (a ``Transformer`` or a pipeline stage).

    Args:
        model: the engine's module.
        cfg: the model config (layers, heads, MTP depth).
        tau: ``train.qk_clip_tau``.
        zero_stage: the ZeRO stage (where the master weights live).
    """

    def __init__(self, model: torch.nn.Module, cfg, tau: float, zero_stage: int):
        self.tau, self.zero_stage = float(tau), zero_stage
        self.layers = cfg.num_layers + cfg.mtp_depth
        self.num_heads = cfg.num_heads
        self.attns = []
        for name, module in model.named_modules():
            if hasattr(module, "qk_logits"):
                module.qk_logits = HeadLogits(module.num_heads)
                rows = module.q_proj.weight if hasattr(module, "q_proj") else module.q_b_proj.weight
                first = _first_row(rows) // (rows.full_shape[0] // cfg.num_heads)
                self.attns.append((_slot(name, cfg.num_layers), first, module))

    @torch.no_grad()
    def after_step(self, applied: bool, device) -> tuple[dict, dict]:
        """Every rank, after ``engine.step()``: the step's maxima over the job, the clip on an
        applied step, and the metrics row's field with W&B's."""
        logits = torch.full((self.layers, self.num_heads), float("-inf"), device=device)
        for slot, first, m in self.attns:
            local = m.qk_logits.take(device)
            logits[slot, first:first + local.numel()] = local
        job_max(logits)
        per_layer = [v if v != float("-inf") else None for v in logits.amax(dim=1).tolist()]
        for slot, _, m in self.attns:       # only layers with a head over tau (read with the row)
            if applied and per_layer[slot] is not None and per_layer[slot] > self.tau:
                for param, scale in row_scales(m, clip_factors(logits[slot], self.tau)):
                    self._scale(param, scale)
        return {"max_logit": per_layer}, {f"max_logit/layer{i}": v for i, v in enumerate(per_layer) if v is not None}

    def _scale(self, param: torch.nn.Parameter, rows: torch.Tensor) -> None:
        """Multiply each row of ``param`` by ``rows`` in the module's tensor and in the master copy."""
        if self.zero_stage == 3 and hasattr(param, "ds_tensor"):
            self._scale_zero3(param, rows)
            return
        factor = rows.to(param.dtype).view(-1, *([1] * (param.dim() - 1))).expand_as(param)
        param.data.mul_(factor)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None:     # ZeRO-1/2, bf16 optimizer: this rank's fp32 fragment
            addr = mapping.lp_fragment_address
            flat = rows.float().view(-1, *([1] * (param.dim() - 1))).expand(param.shape).reshape(-1)
            mapping.hp_fragment.mul_(flat.narrow(0, addr.start, addr.numel).to(mapping.hp_fragment.device))

    def _scale_zero3(self, param, rows: torch.Tensor) -> None:
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param
        shape = tuple(param.ds_shape)
        flat = rows.float().view(-1, *([1] * (len(shape) - 1))).expand(shape).reshape(-1)
        part = param.ds_tensor
        start = rank_in(param.ds_process_group) * part.ds_numel
        n = max(0, min(part.ds_numel, param.ds_numel - start))
        piece = flat.narrow(0, start, n)
        scaled = [part.data]
        part.data.narrow(0, 0, n).mul_(piece.to(part.dtype))
        if param.data.numel() == param.ds_numel and not _shares(param.data, scaled):   # a persistent parameter
            param.data.mul_(flat.view(shape).to(param.dtype))
            scaled.append(param.data)
        master = safe_get_local_fp32_param(param)
        if master is not None and not _shares(master, scaled):
            master = master.clone()
            master.narrow(0, 0, n).mul_(piece.to(master.device))
            safe_set_local_fp32_param(param, master)


def _shares(t: torch.Tensor, others: list[torch.Tensor]) -> bool:
    """Whether ``t`` lies in the storage of one of ``others`` (scaled already: not again)."""
    ptr = t.untyped_storage().data_ptr()
    return any(o.untyped_storage().data_ptr() == ptr for o in others)


def _first_row(param) -> int:
    for dim, idx in getattr(param, "shard_spec", []):
        if dim == 0:
            return int(idx[0])
    return 0


def build_qk_clip(recipe, model, zero_stage: int) -> QKClip | None:
    """The run's ``QKClip``, or None when ``train.qk_clip_tau`` is null."""
    if recipe.train.qk_clip_tau is None:
        return None
    return QKClip(model, model.cfg, recipe.train.qk_clip_tau, zero_stage)
