"""Muon for the hidden matrices, AdamW for the rest, exact at every layout this trainer runs.

Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Liu et al. 2025, arXiv 2502.16982)
keeps a momentum per weight matrix, replaces the update by the nearest semi-orthogonal matrix
(five quintic Newton-Schulz iterations) and scales it to the RMS an AdamW
update would have (``0.2 * sqrt(max(fan_out, fan_in))``, torch.optim.Muon's ``match_rms_adamw``,
as Moonlight does), with decoupled weight decay. Embeddings, the output head, norms, biases, the
router and one-row gates stay on AdamW (``is_muon``). The JSON ``{"type": "Muon", "params":
{...}}`` selects it; ``MUON_KEYS`` lists what it takes.

Why not the libraries' Muon. ``torch.optim.Muon`` takes 2-D parameters only and runs its
Newton-Schulz in bf16. DeepSpeed 0.19.8's (``deepspeed/runtime/zero/muon``) tags every parameter
of 2 or more dimensions not named embed/lm_head for Muon and overwrites any other tag (the router
would land on it); under ZeRO-1/2 it orthogonalises each rank's local tensor, which under this
repo's tensor parallelism is a shard (a different matrix); its shape rule ``sqrt(max(1, rows /
cols))`` reads an (E, H, I) expert stack as if it were (out, in); its ZeRO path clips the
orthogonalised update rather than the gradient, and its Newton-Schulz runs in fp16 wherever the
accelerator supports fp16 (this CPU too), so results depend on the machine. Here:

- ``MuonUpdate.apply`` (``training/optim/muon_update.py``) runs after the step's last backward and DeepSpeed's data-parallel
  reduction, before ``engine.step()``: each Muon matrix's whole averaged gradient is clipped with
  the run's raw gradient norm, folded into the momentum, gathered over tensor parallelism when
  the layer is split (``model/parallel/whole_matrix.py``: every rank's rows or columns in their places),
  orthogonalised in the run's precision (fp32 in an fp32 run) per matrix (an expert stack
  (E, H, I) is E matrices; each expert-parallel rank does its own experts), scaled, and written
  back as the gradient of this rank's part (``safe_set_full_grad``). A ZeRO partition therefore
  never cuts a matrix in the middle of its Newton-Schulz: the matrix is whole when it runs.
  Under ZeRO each matrix has one owner in its data-parallel group, which alone keeps its
  momentum and runs its Newton-Schulz (``MuonUpdate``: memory and work divided by the group's
  size, as ZeRO divides Adam's).
- ``MuonAdamW`` is the optimizer DeepSpeed steps (as a client optimizer: the JSON's optimizer
  section is removed): on a Muon group ``p <- p (1 - lr wd) - lr g`` with ``g`` the update above,
  elementwise and so the same on a ZeRO partition as on the whole tensor; the other groups go to
  ``torch.optim.AdamW`` with their gradients multiplied by the same clip coefficient.
  DeepSpeed's own clipping is off (``gradient_clipping`` moves here), and ``grad_norm`` in
  ``metrics.jsonl`` is the raw gradient's, as with AdamW.

Costs: at ZeRO 1-3 each Muon matrix's gradient goes to its owner and the update comes back (a
reduce and a broadcast, one all-reduce's worth of traffic per matrix, after backward and not
overlapped with it); at fp32 ZeRO-0 every rank keeps every momentum and runs every
Newton-Schulz, as it keeps every Adam moment there. The memory estimator counts the momentum
and the update's buffers (``planning/muon_cost.py``). The momentum is saved per rank
(``trainer_state_rank<r>.pt``, ``muon``) and goes through the universal conversion beside
DeepSpeed's state (``interop/universal.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The JSON's optimizer.params for type Muon. lr / weight_decay: both halves (``muon_lr`` and
# ``adam_lr`` override the lr of one half, as in DeepSpeed); momentum, nesterov, ns_steps,
# adjust_lr_fn: Muon's; betas, eps: AdamW's.
MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "adjust_lr_fn", "betas", "eps",
             "muon_lr", "adam_lr", "ns_method")
ADJUST_LR_FNS = ("match_rms_adamw", "original")


def is_muon_type(ds_config: dict) -> bool:
    """Whether the DeepSpeed JSON asks for Muon (``optimizer.type``, any case)."""
    return str(((ds_config.get("optimizer") or {}).get("type", ""))).lower() == "muon"


@dataclass(frozen=True)
class MuonSettings:
    """The JSON's ``optimizer.params`` for type Muon, checked (``from_json``)."""

    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    adjust_lr_fn: str = "match_rms_adamw"
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    muon_lr: float | None = None
    adam_lr: float | None = None

    @classmethod
    def from_json(cls, params: dict) -> "MuonSettings":
        """Raises ValueError naming the field and the fix for a key this optimizer cannot honour."""
        params = dict(params or {})
        for key in params:
            if key not in MUON_KEYS:
                raise ValueError(f"ds_config.optimizer.params.{key}: {params[key]!r} is not a Muon parameter here "
                                 f"(remove it; known: {', '.join(MUON_KEYS)})")
        method = params.pop("ns_method", "standard")
        if method != "standard":
            raise ValueError(f"ds_config.optimizer.params.ns_method: {method!r} is not run here: Newton-Schulz is the "
                             f"standard quintic in the run's precision (remove it, or set \"standard\")")
        if "lr" not in params:
            raise ValueError("ds_config.optimizer.params.lr: missing, Muon needs a learning rate (e.g. 0.02 with "
                             "adjust_lr_fn \"original\", or AdamW's lr with \"match_rms_adamw\")")
        momentum = params.get("momentum", 0.95)
        if not isinstance(momentum, (int, float)) or isinstance(momentum, bool) or not 0 <= momentum < 1:
            raise ValueError(f"ds_config.optimizer.params.momentum: {momentum!r} must be a number in [0, 1) (e.g. 0.95)")
        steps = params.get("ns_steps", 5)
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps < 100:
            raise ValueError(f"ds_config.optimizer.params.ns_steps: {steps!r} must be an integer in [1, 100) (e.g. 5)")
        fn = params.get("adjust_lr_fn", "match_rms_adamw")
        if fn not in ADJUST_LR_FNS:
            raise ValueError(f"ds_config.optimizer.params.adjust_lr_fn: {fn!r} is not a rule "
                             f"(use one of {list(ADJUST_LR_FNS)})")
        if not isinstance(params.get("nesterov", True), bool):
            raise ValueError(f"ds_config.optimizer.params.nesterov: {params['nesterov']!r} must be true or false")
        for key in ("muon_lr", "adam_lr"):
            v = params.get(key)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"ds_config.optimizer.params.{key}: {v!r} must be > 0 (or left out for lr)")
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        return cls(**params)

    @property
    def muon_group_lr(self) -> float:
        return float(self.muon_lr if self.muon_lr is not None else self.lr)

    @property
    def adam_group_lr(self) -> float:
        return float(self.adam_lr if self.adam_lr is not None else self.lr)


def _shape(p: torch.Tensor) -> tuple:
    """The shape of this rank's tensor (ZeRO-3 keeps it as ``ds_shape`` while partitioned)."""
    return tuple(getattr(p, "ds_shape", p.shape))


def is_muon(name: str, p: torch.Tensor) -> bool:
    """Muon takes the hidden matrices: 2-D weights and 3-D expert stacks (E matrices each). AdamW
    takes vectors (norms, biases), the embeddings and the output head (a lookup and a classifier,
    whose rows move with their tokens' frequencies), the router (``mlp.gate``: its rows are the
    experts' scores, balanced by the aux loss, not a hidden map) and a gate with one row
    (``shared_expert_gate``: a vector stored as a matrix)."""
    shape = tuple(getattr(p, "full_shape", _shape(p)))
    if len(shape) < 2 or min(shape[-2:]) == 1:
        return False
    return not ("embed" in name or "lm_head" in name or name.endswith("mlp.gate.weight"))


def param_groups(model: torch.nn.Module, base_groups: list[dict]) -> list[dict]:
    """Split each of ``training.optim.optimizers.param_groups``'s groups into its Muon and AdamW
    halves (``"<name>-muon"``, ``"<name>-adam"``; empty halves left out), each with ``"muon"``."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in base_groups:
        for use_muon, suffix in ((True, "muon"), (False, "adam")):
            params = [p for p in group["params"] if is_muon(names[id(p)], p) is use_muon]
            if params:
                out.append({**group, "params": params, "name": f"{group['name']}-{suffix}", "muon": use_muon})
    return out


def group_lines(model: torch.nn.Module, groups: list[dict]) -> list[str]:
    """One line per group for the start-up log: name, optimizer, count, elements, examples."""
    names = {id(p): n for n, p in model.named_parameters()}
    lines = []
    for g in groups:
        kinds = sorted({_kind(names[id(p)]) for p in g["params"]})
        numel = sum(math.prod(_shape(p)) for p in g["params"])
        lines.append(f"optimizer group {g['name']}: {'Muon' if g['muon'] else 'AdamW'}, {len(g['params'])} tensors, "
                     f"{numel:,} elements, lr {g['lr']:g}, weight decay {g['weight_decay']:g}: {', '.join(kinds)}")
    return lines


def assignment(model: torch.nn.Module, groups: list[dict]) -> dict:
    """``config.json``'s record of which optimizer takes which parameter kind."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {g["name"]: {"optimizer": "Muon" if g["muon"] else "AdamW",
                        "kinds": sorted({_kind(names[id(p)]) for p in g["params"]}),
                        "tensors": len(g["params"])} for g in groups}


def _kind(name: str) -> str:
    """A parameter's name without its layer index: ``layers.3.mlp.up_proj.weight`` -> ``mlp.up_proj.weight``."""
    parts = name.split(".")
    while parts and (parts[0].isdigit() or parts[0] in ("layers", "mtp", "block")):
        parts = parts[1:]
    return ".".join(parts) or name


class MuonAdamW(torch.optim.Optimizer):
    """The update DeepSpeed steps: Muon groups (``"muon": True``) ``p <- p (1 - lr wd) - lr g``,
    where ``MuonUpdate`` has already made ``g`` the scaled, orthogonalised update; the other groups
    ``torch.optim.AdamW`` with their gradients times ``grad_scale`` (the clip coefficient
    ``MuonUpdate`` leaves here each step). Works on whole tensors and on ZeRO's flat partitions
    alike (every operation is elementwise)."""

    def __init__(self, groups: list[dict], settings: MuonSettings):
        for g in groups:
            g.setdefault("lr", settings.muon_group_lr if g["muon"] else settings.adam_group_lr)
        super().__init__(groups, dict(lr=settings.lr, weight_decay=settings.weight_decay, muon=False,
                                      betas=tuple(settings.betas), eps=settings.eps))
        self.grad_scale: torch.Tensor | float = 1.0
        self._adamw = torch.optim.AdamW([{"params": [torch.zeros(1)]}], lr=settings.adam_group_lr,
                                        betas=tuple(settings.betas), eps=settings.eps,
                                        weight_decay=settings.weight_decay)
        self._link()

    def _link(self) -> None:
        adam = [g for g in self.param_groups if not g["muon"]]
        for g in adam:
            for key, value in self._adamw.defaults.items():
                g.setdefault(key, value)
        self._adamw.param_groups, self._adamw.state = adam, self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (DeepSpeed passes no closure)."""
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure: MuonUpdate must run between backward and the step")
        self._link()        # DeepSpeed's ZeRO swaps each group's params for its flat partition
        scaled = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["muon"]:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(p.grad, alpha=-group["lr"])
                else:
                    scaled.append(p.grad)
        if scaled and not (isinstance(self.grad_scale, float) and self.grad_scale == 1.0):
            torch._foreach_mul_(scaled, self.grad_scale)
        self._adamw.step()


def build_optimizer(ds_config: dict, model: torch.nn.Module,
                    base_groups: list[dict]) -> tuple[MuonAdamW, dict]:
    """``MuonAdamW`` on ``model``'s parameters for a JSON of type Muon, and the JSON DeepSpeed
    gets: without the optimizer section (a client optimizer; DeepSpeed's own Muon, and its tags,
    stay out), with ZeRO told to accept it and with ``gradient_clipping`` 0 (``MuonUpdate`` clips
    the raw gradient instead). The optimizer keeps the start-up lines and ``config.json``'s record
    of which group goes where (``group_lines``, ``assignment``)."""
    import copy
    settings = MuonSettings.from_json((ds_config.get("optimizer") or {}).get("params"))
    groups = param_groups(model, base_groups)
    optimizer = MuonAdamW(groups, settings)
    optimizer.group_lines = group_lines(model, optimizer.param_groups)
    optimizer.assignment = assignment(model, optimizer.param_groups)
    out = copy.deepcopy(ds_config)
    del out["optimizer"]
    out["gradient_clipping"] = 0.0
    if int((out.get("zero_optimization") or {}).get("stage", 0)) > 0:
        out["zero_allow_untested_optimizer"] = True
    return optimizer, out
