"""A native checkpoint of any layout, read one parameter at a time (``interop/universal.py``).

DeepSpeed writes a checkpoint in one of three shapes, and every layout this trainer runs is one
of them per model rank (pipeline stage x tp x ep rank):

- **flat** (ZeRO-1/2, and bf16 under ZeRO-0 or pipelines: ``[bf16_]zero_pp_rank_<d>_mp_rank_<f>
  _optim_states.pt``): each data-parallel rank d holds a contiguous range of every optimizer
  group's flat fp32 buffer and of its Adam moments; ``param_slice_mappings`` names the range of
  each parameter, and a parameter's ranges follow each other over d.
- **zero3** (``zero_pp_rank_<d>_mp_rank_<f>_optim_states.pt`` with ``zero_stage`` 3): every
  parameter is cut into dp pieces of ceil(numel / dp); rank d's flat buffers (its sub-groups one
  after another) hold its piece of each parameter in the order of ``param_shapes``.
- **whole** (fp32 ZeRO-0: ``mp_rank_<f>_model_states.pt``): the torch optimizer's state per
  parameter index, its fp32 weights in ``module`` (or the pipeline's ``layer_*`` files); the
  indices are named by ``param_names``, which the trainer records in every checkpoint.

File f is model rank f: under pipelines stage f // (tp x ep), tp x ep rank f % (tp x ep).
Pipeline names (``3.layers.2.mlp...``, ``tied_modules.embed.embed_tokens.weight``) are read as
the Transformer's (``canonical_name``); a tied weight is taken from its first stage. The tp x ep
copies of a parameter are merged into its full tensor by the cut each records (``shard_spec``,
from the model built on the meta device at the source layout). Every file is opened once,
memory-mapped and weights-only (``safe_load``): a parameter's full tensors are the only ones
materialised.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.parallel.draw import canonical_name
from training.checkpoint import safe_load
from training.checkpoint.layout import PARAM_NAMES
from training.checkpoint.shard_maps import runs_of

_ZERO = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_STATES = re.compile(r"^(?:zero_pp_rank_0_)?mp_rank_(\d+)_model_states\.pt$")
FP32 = "fp32"


@dataclass
class _Copy:
    """One model rank's copy of a parameter: ``pieces`` in data-parallel order, each
    (file, group, start, numel) of a flat buffer (flat, zero3), or for ``whole``
    (file, group, index in group, optimizer state index, weight source)."""
    mp: int
    shape: tuple
    group: str
    stage: int
    pieces: list = field(default_factory=list)


class NativeCheckpoint:
    """The checkpoint folder ``folder`` of a run at ``world`` (config.json's ``world``), model
    ``cfg``. ValueError (one line) for what it cannot read."""

    def __init__(self, folder: Path, cfg, world: dict, placement: str = "contiguous"):
        self.folder, self.cfg = Path(folder), cfg
        self.tp, self.ep = int(world.get("tensor_parallel_size", 1)), int(world.get("expert_parallel_size", 1))
        self.pp, self.mp = int(world.get("pipeline_parallel_size", 1)), self.tp * self.ep
        self._open: dict[Path, dict] = {}
        self.optimizer_state = True      # False: a ZeRO-0 checkpoint of older code (weights only)
        self.specs = source_specs(cfg, self.tp, self.ep, placement)
        self.buffer_names = self.specs["buffers"]
        self.copies: dict[str, dict[int, _Copy]] = {}
        self.groups: dict[str, dict] = {}                        # optimizer group name -> settings
        self.buffer_files: dict[str, tuple] = {}                # name -> (file, key or None, key)
        zero = sorted(((int(m.group(3)), int(m.group(2)), f) for f in self.folder.iterdir()
                       if (m := _ZERO.match(f.name))))
        first = self._load(zero[0][2])["optimizer_state_dict"] if zero else None
        if first is None:
            self.kind, self.stage = "whole", 0
        else:
            self.kind = "zero3" if int(first.get("zero_stage", 1)) == 3 else "flat"
            self.stage = int(first.get("zero_stage", 0)) if "zero_stage" in first else 0
        files = max([f for f, _, _ in zero] + [self._states_files()[-1][0]]) + 1
        if files != self.pp * self.mp:
            raise ValueError(f"{self.folder}: {files} model ranks' files, the run's config.json says pp "
                             f"{self.pp} x tp {self.tp} x ep {self.ep}: restore the checkpoint or its config.json")
        for f in range(files):
            mine = [path for g, _, path in zero if g == f]
            {"flat": self._index_flat, "zero3": self._index_zero3, "whole": self._index_whole}[self.kind](f, mine)
        self.dp = max((len(c.pieces) for by_mp in self.copies.values() for c in by_mp.values()), default=1)
        self._index_buffers()

    # -- the index --------------------------------------------------------------------------------

    def _load(self, path: Path) -> dict:
        if path not in self._open:
            try:
                self._open[path] = safe_load.load(path, mmap=True)
            except RuntimeError as err:             # not torch's zip format: a legacy or damaged
                if "mmap can only be used" not in str(err):     # file, read whole (and judged)
                    raise
                self._open[path] = safe_load.load(path)
        return self._open[path]

    def _states_files(self) -> list[tuple[int, Path]]:
        found = sorted((int(m.group(1)), f) for f in self.folder.iterdir() if (m := _STATES.match(f.name)))
        if not found:
            raise ValueError(f"{self.folder}: no mp_rank_XX_model_states.pt (not a DeepSpeed checkpoint)")
        return found

    def states(self, f: int = 0) -> dict:
        """Model rank f's ``*mp_rank_<f>_model_states.pt`` (client_state, lr scheduler, counters)."""
        return self._load(dict(self._states_files())[f])

    def _add(self, f: int, name: str, shape, group: str, piece) -> None:
        name, mp = canonical_name(name), f % self.mp
        by_mp = self.copies.setdefault(name, {})
        copy = by_mp.get(mp)
        if copy is None:
            copy = by_mp[mp] = _Copy(mp, tuple(shape), group, f // self.mp)
        if copy.stage == f // self.mp:          # a tied weight: its first stage's copy
            copy.pieces.append(piece)

    def _group_names(self, f: int, groups: list) -> list[str]:
        out = []
        for g in groups:
            settings = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            out.append(str(g.get("name", len(out))))
            self.groups.setdefault(out[-1], settings)
        return out

    def _index_flat(self, f: int, files: list[Path]) -> None:
        shapes = {k: v for group in self.states(f).get("param_shapes") or [] for k, v in group.items()}
        for path in files:
            opt = self._load(path)["optimizer_state_dict"]
            names = self._group_names(f, opt["base_optimizer_state"]["param_groups"])
            for g, mapping in enumerate(opt["param_slice_mappings"]):
                for name, frag in mapping.items():
                    self._add(f, name, shapes[name], names[g], (path, g, frag.start, frag.numel))

    def _index_zero3(self, f: int, files: list[Path]) -> None:
        dp = len(files)
        shapes = self.states(f).get("param_shapes") or []       # one dict per sub-group
        groups = self._load(files[0])["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]
        names = self._group_names(f, groups)
        group_of = {sg: names[g] for g, group in enumerate(groups) for sg in group["params"]}
        offset = 0
        for sg, sub_group in enumerate(shapes):
            for name, shape in sub_group.items():
                part = math.ceil(math.prod(shape) / dp)
                for path in files:
                    self._add(f, name, shape, group_of[sg], (path, sg, offset, part))
                offset += part

    def _index_whole(self, f: int, files: list[Path]) -> None:
        states = self.states(f)
        recorded = states.get(PARAM_NAMES)
        opt = states.get("optimizer")
        weights = self._weights(f, states)
        if not recorded or not isinstance(opt, dict):    # older code: the weights alone are named
            self.optimizer_state = False
            for name, source in weights.items():
                tensor = self._tensor(source, states)
                if name not in self.buffer_names:
                    self._add(f, name, tensor.shape, "", (f, None, None, None, source))
            return
        inner = opt.get("optimizer_state_dict", opt)      # bf16's FP16_UnfusedOptimizer wraps torch's
        names = self._group_names(f, inner["param_groups"])
        for g, (group, group_names) in enumerate(zip(inner["param_groups"], recorded)):
            for i, (index, name) in enumerate(zip(group["params"], group_names)):
                source = ("fp32_groups", g, i) if "fp32_groups" in opt else weights[name]
                shape = self._tensor(source, states).shape
                self._add(f, name, shape, names[g], (f, g, i, index, source))

    def _weights(self, f: int, states: dict) -> dict:
        """Name -> (file, key) of model rank f's module weights (fp32 ZeRO-0)."""
        if states.get("module") is not None:
            return {k: ("module", k) for k in states["module"]}
        stage_mp = f % self.mp
        out = {}
        for path in sorted(self.folder.glob(f"layer_*-model_{stage_mp:02d}-model_states.pt")):
            out.update({k: (path, k) for k in self._load(path)})
        return out

    def _tensor(self, source, states: dict) -> torch.Tensor:
        if source[0] == "fp32_groups":
            return states["optimizer"]["fp32_groups"][source[1]][source[2]]
        if source[0] == "module":
            return states["module"][source[1]]
        return self._load(source[0])[source[1]]

    def _index_buffers(self) -> None:
        """The persistent buffers (the routers' ``e_score_correction_bias``): the same on every
        rank, so the first file's copy; in ``module`` or, under pipelines, the layer files."""
        found = [(path, "module", k) for _, path in self._states_files()
                 for k in (self._load(path).get("module") or {})]
        found += [(path, None, k) for path in sorted(self.folder.glob("layer_*-model_*-model_states.pt"))
                  for k in self._load(path)]
        for path, key, k in found:
            if canonical_name(k) in self.buffer_names:
                self.buffer_files.setdefault(canonical_name(k), (path, key, k))

    # -- reading ----------------------------------------------------------------------------------

    def keys(self, name: str) -> list[str]:
        """The tensors a parameter has: ``fp32`` and its optimizer state's (Adam: ``exp_avg``,
        ``exp_avg_sq``; none for a Muon matrix, whose momentum is the trainer's)."""
        copy = next(iter(self.copies[name].values()))
        return [FP32] + [k for k in self._state(copy.pieces[0]) if k != "step"]

    def _state(self, piece) -> dict:
        if self.kind == "whole":
            f, _, _, index, _ = piece
            if not self.optimizer_state:
                return {}
            opt = self.states(f)["optimizer"]
            return opt.get("optimizer_state_dict", opt)["state"].get(index, {})
        path, g, _, _ = piece
        opt = self._load(path)["optimizer_state_dict"]
        if self.kind == "flat":
            return opt["base_optimizer_state"]["state"].get(g, {})
        return opt["optimizer_state_dict"]["state"].get(g, {})      # zero3: g is the sub-group

    def step(self, name: str):
        """The optimizer's step count of the parameter (None for a Muon matrix)."""
        copy = next(iter(self.copies[name].values()))
        return self._state(copy.pieces[0]).get("step")

    def _flats(self, path: Path, g, key: str) -> list[torch.Tensor]:
        opt = self._load(path)["optimizer_state_dict"]
        if self.kind == "flat":
            return [opt["single_partition_of_fp32_groups"][g] if key == FP32
                    else opt["base_optimizer_state"]["state"][g][key]]
        flats = list(opt["fp32_flat_groups"])
        if key == FP32:
            return flats
        state = opt["optimizer_state_dict"]["state"]   # a sub-group without it (Muon's): its length
        return [state[sg][key] if key in state.get(sg, {}) else flat for sg, flat in enumerate(flats)]

    def _copy_tensor(self, copy: _Copy, key: str) -> torch.Tensor:
        if self.kind == "whole":
            f, _, _, index, source = copy.pieces[0]
            if key == FP32:
                return self._tensor(source, self.states(f)).float()
            return self._state(copy.pieces[0])[key].float()
        parts = [_range(self._flats(path, g, key), start, numel) for path, g, start, numel in copy.pieces]
        numel = math.prod(copy.shape)
        return torch.cat(parts)[:numel].float().view(copy.shape)

    def full(self, name: str, key: str) -> torch.Tensor:
        """The full tensor ``key`` (``keys``) of parameter ``name``: its data-parallel pieces
        joined, its tp x ep copies merged by their cuts (a replicated one read once)."""
        by_mp = self.copies[name]
        if replicated(name, self.specs, by_mp):
            return self._copy_tensor(by_mp[min(by_mp)], key)
        return self.merge(name, {mp: self._copy_tensor(copy, key) for mp, copy in by_mp.items()})

    def merge(self, name: str, shards: dict[int, torch.Tensor]) -> torch.Tensor:
        """The full tensor of parameter ``name`` from its tp x ep ranks' ``shards``, each written
        into place box by box (runs of consecutive indices) by the rank's ``shard_spec``;
        ValueError when the shards leave part of it unwritten (a missing rank's experts)."""
        return merge(name, self.specs, shards)

    def buffer(self, name: str) -> torch.Tensor:
        path, key, k = self.buffer_files[name]
        sd = self._load(path)
        return (sd[key] if key else sd)[k].float()


def replicated(name: str, specs: dict, ranks) -> bool:
    """Whether every one of ``ranks`` holds parameter ``name`` whole (``source_specs``)."""
    shape = specs["full"][name]
    return not any(list(idx) != list(range(shape[dim])) for mp in ranks for dim, idx in specs[mp][name])


def merge(name: str, specs: dict, shards: dict[int, torch.Tensor]) -> torch.Tensor:
    """``NativeCheckpoint.merge`` for ``specs`` (``source_specs``) and tp x ep ``shards``."""
    full_shape = specs["full"][name]
    if replicated(name, specs, shards):
        return shards[min(shards)].float()                     # replicated: one copy
    out, written = torch.empty(full_shape), set()
    for mp, shard in sorted(shards.items()):
        index = [list(range(n)) for n in full_shape]
        for dim, idx in specs[mp][name]:
            index[dim] = [index[dim][i] for i in idx]
        for box in _boxes(index):
            key = tuple((s, n) for s, _, n in box)
            if key not in written:              # replicas of a box (e.g. over ep) are written once
                written.add(key)
                out[tuple(slice(s, s + n) for s, _, n in box)] = shard[tuple(slice(d, d + n) for _, d, n in box)]
    covered = sum(math.prod(n for _, n in key) for key in written)
    if covered != math.prod(full_shape):
        raise ValueError(f"{name}: the model-parallel shards cover {covered} of its {math.prod(full_shape)} "
                         f"elements (ranks {sorted(shards)} found): a shard file is missing")
    return out


def _boxes(index: list[list[int]]):
    import itertools
    return itertools.product(*map(runs_of, index))


def _range(flats: list[torch.Tensor], start: int, numel: int) -> torch.Tensor:
    """Elements [start, start + numel) of the flat buffers ``flats`` laid one after another."""
    out, pos = [], 0
    for flat in flats:
        n = flat.numel()
        lo, hi = max(start, pos), min(start + numel, pos + n)
        if lo < hi:
            out.append(flat.reshape(-1)[lo - pos:hi - pos])
        pos += n
    return torch.cat(out) if len(out) != 1 else out[0]


def source_specs(cfg, tp: int, ep: int, placement: str) -> dict:
    """{mp rank: {name: shard_spec}, "full": {name: full shape}, "buffers": {persistent buffer
    names}} of the model at tp x ep, built on the meta device without weights."""
    from model import Transformer
    from model.parallel.groups import ParallelGroups
    out: dict = {"full": {}}
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            groups = ParallelGroups(tp=tp, ep=ep, tp_rank=tp_rank, ep_rank=ep_rank, expert_placement=placement)
            with torch.device("meta"):
                model = Transformer(cfg, groups, init_seed=None)
            out[ep_rank * tp + tp_rank] = {n: p.shard_spec for n, p in model.named_parameters()}
            out["full"].update({n: tuple(p.full_shape) for n, p in model.named_parameters()})
            out["buffers"] = set(model.state_dict()) - set(out["full"])       # persistent buffers
    return out
