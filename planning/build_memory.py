"""Memory of building the model, before ``deepspeed.initialize``: per rank, host and device apart.

The build is ``training.engine.build.build_model``. Its peak per rank is the model states as built,
divided by the ranks that share them, plus the largest layer drawn in fp32:

- ZeRO-3 (``training/engine/sharded_build.py``): ``zero.Init`` creates each module's parameters in the
  training dtype and partitions them over DeepSpeed's data-parallel group, dp x cp ranks, as the
  module's constructor returns: ``params`` = a psi / (dp x cp), on the device (on the host under
  ``offload_param``). While a module is created it is whole at this rank's layout and broadcast
  from that group's rank 0: ``construct`` = 2 a x the largest
  module (its tensors and a receive buffer), on the device. Then each rank draws its tp/ep
  shard of each tensor in fp32 on the host and writes its partition: ``draw`` = 4 x
  ``largest_draw``.
- ZeRO 0-2: the rank's whole shard in fp32 on the host (``params`` = 4 psi), plus the draw;
  ``deepspeed.initialize`` then moves it to the device (counted in the model states).

Checked against the peak RSS of a 0.8B-parameter ZeRO-3 build on 2 gloo ranks
(``tests/training/engine/test_sharded_build.py``).
"""

from __future__ import annotations

import math

from model.config import TransformerConfig
from model.parallel.draw import block_length
from planning.memory_model import (DTYPE_BYTES, FP32, Layout, _offloaded, local_params,
                                   precision_of)


def largest_draw(cfg: TransformerConfig, layout: Layout) -> int:
    """Elements alive while the build draws its largest parameter: each rank draws only the
    blocks of its tp/ep shard, one tile at a time, into the shard (``model/parallel/draw.py``),
    so this rank's shard plus one tile (its rows, columns or expert slice of one block).
    Candidates: the vocabulary rows, the query (MLA: query up-) projection, an MLP projection, one stacked
    expert projection (E, H, I) and a shared-expert projection."""
    h, f, fe, tp = cfg.hidden_size, cfg.ffn_hidden_size, cfg.expert_ffn_size, layout.tp
    q, q_in = cfg.num_heads * cfg.qk_head_dim, (cfg.q_lora_rank or h) if cfg.mla else h
    kinds = [(math.ceil(cfg.vocab_size / tp) * h, block_length(cfg.vocab_size) * h),
             (q // tp * q_in, block_length(q) * q_in), (h * (f // tp), h * block_length(f))]
    if cfg.moe is not None:
        e, fs = cfg.moe.num_experts, cfg.moe.shared_ffn_size(fe)
        kinds += [(e // layout.ep * h * (fe // tp), h * block_length(fe))]      # tiles of one expert
        if fs:
            kinds += [(h * (fs // tp), h * block_length(fs))]
    return max(shard + tile for shard, tile in kinds)


def build_bytes(cfg: TransformerConfig, layout: Layout, ds: dict, stage: int = 0) -> dict[str, float]:
    """Peak bytes per rank of pipeline stage ``stage`` while the model is built (see the module
    docstring). ``host`` and ``device`` are per rank; ``cpu_peak`` is the peak when host and
    device are one memory (the CPU accelerator), where the construction comes before the draw.
    """
    zero = ds.get("zero_optimization") or {}
    params = local_params(cfg, layout, stage)
    draw = FP32 * largest_draw(cfg, layout)
    if int(zero.get("stage", 0)) == 3:
        a = DTYPE_BYTES[precision_of(ds)]
        built = a * params["total"] / layout.dp
        construct = 2 * a * params["largest_module"]
        offloaded = _offloaded(zero, "offload_param")
        host = draw + (built if offloaded else 0.0)
        device = construct + (0.0 if offloaded else built)
    else:
        built, construct = FP32 * params["total"], 0.0
        host, device = built + draw, 0.0
    return {"params": built, "construct": construct, "draw": draw, "host": host,
            "device": device, "cpu_peak": built + max(construct, draw)}
