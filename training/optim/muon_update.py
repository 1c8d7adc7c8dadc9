"""Muon's update of the hidden matrices at every layout (``training/optim/muon.py`` says what
Muon is and why the trainer runs its own): Newton-Schulz, the per-matrix lr ratio, the gather of
tensor-parallel shards (``model/parallel/whole_matrix.py``) and ``MuonUpdate``, which runs between DeepSpeed's gradient
reduction and ``engine.step()``; ``build_update`` makes the run's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from model.parallel.whole_matrix import TpShards, broadcast_from, group_size, owner_of, rank_in, reduce_to

from training.optim.muon import MuonSettings, _shape, is_muon, is_muon_type

MOMENTUM = "muon_momentum"      # the universal checkpoint's folder of whole momenta (interop/universal.py)

# Keller Jordan's quintic coefficients (torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of each matrix in ``g`` (the last two dims; any
    leading dims are a batch, e.g. experts), in ``dtype``: torch.optim.Muon's iteration, which runs
    only in bf16 and only on 2-D tensors. Each matrix is divided by its Frobenius norm (+1e-7),
    turned wide, iterated ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, turned back."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def lr_ratio(fan_out: int, fan_in: int, rule: str) -> float:
    """The per-matrix factor on the lr: ``match_rms_adamw`` 0.2 sqrt(max(A, B)) (Moonlight: the
    update's RMS matched to AdamW's, so AdamW's lr and decay carry over); ``original``
    sqrt(max(1, fan_out / fan_in)) (Keller Jordan's)."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(fan_out, fan_in))
    return math.sqrt(max(1.0, fan_out / fan_in))


@dataclass
class _Matrix:
    name: str
    param: torch.nn.Parameter
    ratio: float                    # lr_ratio of one of its matrices (full shape)
    tp: TpShards | None             # None: whole on this rank
    group: object = None            # under ZeRO: its data-parallel group, the owner's global rank,
    owner: int = 0                  # and whether this rank is it (MuonUpdate._assign_owners)
    mine: bool = True


def _matrix(name: str, p: torch.nn.Parameter, rule: str, groups) -> _Matrix:
    """How Muon sees ``p``: its full shape gives the ratio (a 3-D expert stack (E, H, I) or
    (E, I, H) is used as ``x @ W``, so fan_in is dim 1 and fan_out dim 2; a 2-D Linear weight is
    (out, in)); a split over tp along a dim other than the expert dim is gathered."""
    full = tuple(getattr(p, "full_shape", _shape(p)))
    fan_out, fan_in = (full[2], full[1]) if len(full) == 3 else (full[0], full[1])
    tp = None
    for dim, idx in getattr(p, "shard_spec", []):
        if len(idx) < full[dim] and not (len(full) == 3 and dim == 0) and groups is not None and groups.tp > 1:
            tp = TpShards(dim, list(idx), groups.tp_group, p.device)
    return _Matrix(name, p, lr_ratio(fan_out, fan_in, rule), tp)


class MuonUpdate:
    """The Muon part of a step, between DeepSpeed's reduction and ``engine.step()`` (module
    docstring). ``apply(norm)`` on an applied step; its momentum is the part's checkpoint state.

    Where ZeRO partitions the optimizer (ZeRO 1-3, and DeepSpeed's bf16 optimizer at ZeRO-0),
    each Muon matrix has one owner in its data-parallel group of n ranks (expert stacks: their
    expert-data-parallel group), chosen to balance the elements each rank owns (``_assign_owners``):
    the group reduces each matrix's gradient pieces to the owner, the owner alone keeps its
    momentum and runs its Newton-Schulz, and broadcasts the update, of which every rank keeps
    its ZeRO part. Momentum memory and Newton-Schulz work are divided by n, the traffic is one
    all-reduce's worth per matrix (a reduce and a broadcast), and the owners of a group of n
    matrices run their Newton-Schulz at the same time. At fp32 ZeRO-0 every rank holds the
    whole averaged gradient and the whole optimizer state, and so does Muon there.

    Args:
        engine: the DeepSpeed engine whose optimizer is ``MuonAdamW``.
        settings: the JSON's Muon settings.
        max_norm: the JSON's ``gradient_clipping`` (0: off), taken over from DeepSpeed.
        groups: the run's ``ParallelGroups`` (tp, for split matrices).
        whole_grads: True where ``.grad`` holds the whole averaged gradient (fp32 ZeRO-0).
    """

    def __init__(self, engine, settings: MuonSettings, max_norm: float, groups, whole_grads: bool):
        self.settings, self.max_norm, self.whole_grads = settings, float(max_norm), whole_grads
        self.optimizer = getattr(engine, "basic_optimizer", None) or engine.optimizer
        self.dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
        named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad and is_muon(n, p)]
        self.matrices = [_matrix(n, p, settings.adjust_lr_fn, groups) for n, p in named]
        self.momentum: dict[str, torch.Tensor] = {}
        self.mp_rank = groups.mp_rank if groups is not None else 0     # names the shards at conversion
        self.chunk = 1
        if not whole_grads:
            self._assign_owners()

    def _assign_owners(self) -> None:
        """Give each matrix an owner in its data-parallel group: largest first to the rank with
        the fewest elements so far (lowest rank on a tie), the same choice on every rank."""
        by_group: dict[int, list[_Matrix]] = {}
        for m in self.matrices:
            m.group = getattr(m.param, "ds_process_group", None) or m.param._dp_group
            by_group.setdefault(id(m.group), []).append(m)
        for members in by_group.values():
            load = [0] * group_size(members[0].group)
            for m in sorted(members, key=lambda m: -math.prod(_shape(m.param))):      # stable: model order
                r = load.index(min(load))
                load[r] += math.prod(_shape(m.param))
                m.owner, m.mine = owner_of(m.group, r)
            self.chunk = max(self.chunk, len(load))

    def _update(self, m: _Matrix, g: torch.Tensor) -> torch.Tensor:
        """The scaled, orthogonalised update of matrix ``m`` from its (clipped) whole gradient."""
        s = self.settings
        buf = self.momentum.get(m.name)
        if buf is None:
            buf = self.momentum[m.name] = torch.zeros_like(g)
        buf.mul_(s.momentum).add_(g)
        u = g.add(buf, alpha=s.momentum) if s.nesterov else buf
        if m.tp is not None:
            u = m.tp.mine(newton_schulz(m.tp.whole(u), s.ns_steps, self.dtype))
        else:
            u = newton_schulz(u, s.ns_steps, self.dtype)
        return u.float() * m.ratio

    def clip_coef(self, norm) -> torch.Tensor | float:
        """``min(1, max_norm / (norm + 1e-6))`` (torch's and DeepSpeed's rule) of the raw norm, a
        float or a device tensor (no host copy); 1.0 without clipping."""
        if self.max_norm <= 0:
            return 1.0
        if torch.is_tensor(norm):
            return (self.max_norm / (norm.float() + 1e-6)).clamp(max=1.0)
        return min(1.0, self.max_norm / (norm + 1e-6))

    @torch.no_grad()
    def apply(self, norm) -> None:
        """Turn every Muon gradient into its update, in place; leave the AdamW groups' clip
        coefficient on the optimizer. ``norm``: the raw global gradient norm of the step."""
        coef = self.clip_coef(norm)
        self.optimizer.grad_scale = coef
        if self.whole_grads:
            for m in self.matrices:
                m.param.grad.copy_(self._update(m, m.param.grad.float() * coef))
            return
        from deepspeed.utils import safe_set_full_grad
        for start in range(0, len(self.matrices), self.chunk):
            chunk = self.matrices[start:start + self.chunk]
            owned = []
            for m in chunk:                 # each owner gets its matrices' whole gradients
                g = _own_piece(m.param)
                reduce_to(g, m.owner, m.group)
                if m.mine:
                    owned.append((m, g))
            updates = {m.name: self._update(m, g * coef) for m, g in owned}      # owners at once
            for m in chunk:                 # and sends the updates back
                u = updates.pop(m.name) if m.mine else torch.empty(_shape(m.param), device=m.param.device)
                broadcast_from(u, m.owner, m.group)
                safe_set_full_grad(m.param, u)

    def state_dict(self) -> dict:
        return {"momentum": {k: v.detach().cpu() for k, v in self.momentum.items()}, "mp_rank": self.mp_rank}

    def load_universal(self, folder: Path) -> None:
        """The momentum from a universal checkpoint (``interop/universal.py``): each matrix
        this rank keeps, cut out of its whole tensor by the parameter's ``shard_spec``."""
        from model.parallel.draw import canonical_name, take_shard
        saved = {}
        for m in self.matrices:
            if not (self.whole_grads or m.mine):
                continue
            path = Path(folder) / MOMENTUM / f"{canonical_name(m.name)}.pt"
            if not path.is_file():
                raise ValueError(f"universal checkpoint {folder} has no {MOMENTUM}/{path.name}: convert the "
                                 f"Muon run again with this code's launch/to_universal.py")
            whole = torch.load(path, map_location="cpu", weights_only=True)["param"]    # plain data only
            saved[m.name] = take_shard(whole, getattr(m.param, "shard_spec", []))
        self.load_state_dict({"momentum": saved})

    def load_other_world(self, read, saved: int, world: int) -> str:
        """The momentum of a checkpoint saved by ``saved`` ranks at the same tp x ep layout (a
        data-parallel size change, ``TrainState._load_other_world``): each rank reads every saved
        rank's part in turn and keeps the matrices it now keeps (one part in memory at a time)."""
        want = {m.name: _shape(m.param) for m in self.matrices if self.whole_grads or m.mine}
        found: dict[str, torch.Tensor] = {}
        for r in range(saved):
            part = read(r)["momentum"]
            found.update({k: v for k, v in part.items() if k in want and k not in found})
        self.load_state_dict({"momentum": found})
        return f"Muon's momentum of {len(want)} matrices on this rank taken from the {saved} ranks that saved it"

    def load_state_dict(self, state: dict) -> None:
        """Put back the momentum of the matrices this rank keeps; each must be in it, in its shape."""
        saved = state["momentum"]
        mine = [m for m in self.matrices if self.whole_grads or m.mine]
        for m in mine:
            if m.name not in saved:
                raise ValueError(f"the checkpoint's Muon momentum has no {m.name}: it was saved by another "
                                 f"layout or optimizer (resume at the layout that saved it)")
            want = _shape(m.param)
            if tuple(saved[m.name].shape) != want:
                raise ValueError(f"the checkpoint's Muon momentum of {m.name} is {tuple(saved[m.name].shape)}, "
                                 f"this rank holds {want}: resume at the layout that saved it")
        device = self.matrices[0].param.device if self.matrices else "cpu"
        self.momentum = {m.name: saved[m.name].to(device=device, dtype=torch.float32) for m in mine}


def _own_piece(p: torch.nn.Parameter) -> torch.Tensor:
    """A zero fp32 tensor of ``p``'s shape holding this rank's ZeRO piece of its averaged gradient
    (what DeepSpeed's ``get_full_hp_grad`` / ``get_fp32_grad_for_param`` contribute to their
    all-reduce / all-gather; summed over the group, the whole gradient)."""
    shape = _shape(p)
    out = torch.zeros(math.prod(shape), dtype=torch.float32, device=p.device)
    if hasattr(p, "ds_id"):                                         # ZeRO-3: this rank's partition
        from deepspeed.utils import safe_get_local_grad
        local = safe_get_local_grad(p).reshape(-1)
        start = rank_in(p.ds_process_group) * local.numel()
        n = max(0, min(local.numel(), out.numel() - start))
        out.narrow(0, start, n).copy_(local[:n])
    elif getattr(p, "_hp_mapping", None) is not None:              # ZeRO-1/2, bf16 optimizer
        frag = p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group).float().reshape(-1)
        addr = p._hp_mapping.lp_fragment_address
        if frag.numel() == out.numel():     # the bf16 optimizer keeps the whole accumulation buffer
            frag = frag.narrow(0, addr.start, addr.numel)
        out.narrow(0, addr.start, addr.numel).copy_(frag)
    return out.view(shape)


def build_update(ds_config: dict, engine, groups) -> MuonUpdate | None:
    """The run's ``MuonUpdate`` on ``engine`` (built by ``training.engine.build.build_engine``
    from the resolved JSON ``ds_config``), or None when the JSON's optimizer is not Muon."""
    if not is_muon_type(ds_config):
        return None
    settings = MuonSettings.from_json(ds_config["optimizer"].get("params"))
    zero = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    half = bool((ds_config.get("bf16") or {}).get("enabled")) or bool((ds_config.get("fp16") or {}).get("enabled"))
    return MuonUpdate(engine, settings, float(ds_config.get("gradient_clipping", 0.0) or 0.0), groups,
                      whole_grads=zero == 0 and not half)
