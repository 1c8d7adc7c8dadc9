"""Router analysis of a trained MoE model over a text (``launch/analyze_router.py``).

The model runs on one process in eval mode (no jitter, the eval capacity factor inside the
forward). A forward hook on each MoE layer's router (``TopKRouter``) reads its outputs, so the
model's hot path is unchanged; per MoE layer and over every token of the text it accumulates:

- ``tokens_per_expert``: routed (token, slot) assignments before any capacity drop (sums to
  k x tokens), their max/mean, and the entropy of that load distribution;
- ``router_entropy``: the mean over tokens of the router distribution's entropy, in nats;
- ``dropped_frac_train_cf`` / ``dropped_frac_eval_cf``: what the training and the eval capacity
  would drop of the same routing (``plan_dispatch`` on each forward's tokens, split over the
  run's ep ranks as the trainer splits a micro-batch; 0 when dropless);
- ``co_selection``: (E, E) tokens that picked both experts; symmetric, its diagonal is
  ``tokens_per_expert`` (a token picks k distinct experts), all off-diagonal zero for top-1;
- per expert, the token ids it takes most and the most distinctive ones, and the token classes
  (``token_class``), each with its lift: share among the expert's assignments / share in the text
  (a token id always routed to expert e reaches the ceiling T / count_e, about E/k).

``collapsed`` lists the experts below ``EXPERT_COLLAPSE`` x their uniform share k*T/E, and the
layers whose load entropy fell below ``LAYER_COLLAPSE`` x ln E (fewer than sqrt(E) effective
experts, exp(entropy)); both thresholds are written into the report.
"""

from __future__ import annotations

import math
import re
import string
from contextlib import contextmanager
from pathlib import Path

import torch

from model.moe.dispatcher import plan_dispatch
from training.checkpoint.layout import latest_tag, tag_for_step

CLASSES = ("whitespace", "digit", "punctuation", "capitalized", "space_word", "other")
EXPERT_COLLAPSE = 0.1     # an expert below 0.1 x its uniform share k*T/E is collapsed
LAYER_COLLAPSE = 0.5      # a layer whose load entropy is below 0.5 x ln E is collapsed
TOP_TOKENS = 5            # token ids listed per expert, by count and by lift
MIN_TEXT_COUNT = 20       # a token id needs this many occurrences in the text to rank by lift


def token_class(text: str) -> str:
    """The class of one decoded token, the first that applies in ``CLASSES`` order:
    whitespace only; digits (after stripping whitespace); punctuation only; a capitalized word
    (first non-space character upper case); a word led by whitespace (" foo"); other (word
    pieces without leading whitespace, mixed tokens)."""
    core = text.strip()
    if not core:
        return "whitespace"
    if core.isdigit():
        return "digit"
    if all(c in string.punctuation for c in core):
        return "punctuation"
    if core[0].isupper():
        return "capitalized"
    if text[0].isspace() and re.fullmatch(r"\w+", core):
        return "space_word"
    return "other"


def vocabulary(tokenizer, vocab_size: int) -> list[str]:
    """Each token id's decoded text, ids 0 .. vocab_size-1."""
    return [tokenizer.decode([i]) for i in range(vocab_size)]


def windows(tokens: torch.Tensor, seq_len: int, batch_windows: int) -> list[torch.Tensor]:
    """(b, seq_len) batches of consecutive windows covering every token once; a shorter tail is
    its own (1, r) batch."""
    full = tokens.numel() // seq_len
    rows = tokens[:full * seq_len].view(full, seq_len)                   # (n, S)
    batches = list(rows.split(batch_windows)) if full else []
    if tokens.numel() > full * seq_len:
        batches.append(tokens[full * seq_len:].view(1, -1))              # (1, r)
    return batches


def select_checkpoints(ckpt_dir: Path, spec: str) -> list[str]:
    """Tags for ``--checkpoints``: ``latest``, ``all`` (every ``step*`` folder up to the one
    ``latest`` names: a newer folder is an unfinished save), or a comma list of tags or step
    numbers. ValueError (one line) when there is none, or a named one is missing."""
    latest = latest_tag(ckpt_dir)
    if latest is None:
        raise ValueError(f"no complete checkpoint under {ckpt_dir} (train with train.save_every, "
                         f"or let the run finish)")
    if spec == "latest":
        return [latest]
    steps = {t: int(t[4:]) for t in (p.name for p in Path(ckpt_dir).glob("step*") if p.is_dir())
             if t[4:].isdigit()}
    if spec == "all":
        return sorted((t for t, s in steps.items() if s <= steps.get(latest, s)), key=steps.get)
    tags = [tag_for_step(int(t)) if t.strip().isdigit() else t.strip() for t in spec.split(",")]
    missing = [t for t in tags if not (Path(ckpt_dir) / t).is_dir()]
    if missing:
        raise ValueError(f"--checkpoints: no checkpoint {', '.join(missing)} under {ckpt_dir} "
                         f"(there are: {', '.join(sorted(steps, key=steps.get))})")
    return tags


def step_of(tag: str) -> int | None:
    return int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else None


class LayerStats:
    """Routing statistics of one MoE layer, accumulated over forwards (see module docstring).

    Args:
        moe: the layer's MoE config (E, k, capacity factors).
        vocab_size: V, for the (E, V) token-id counts.
        ep: the run's expert-parallel size: each forward's samples are split over ep ranks, and
            each applies its capacity to its own tokens, as in training.
    """

    def __init__(self, moe, vocab_size: int, ep: int = 1):
        E = moe.num_experts
        self.moe, self.vocab_size, self.ep = moe, vocab_size, ep
        self.tokens = 0
        self.entropy_sum = 0.0
        self.dropped = {"train": 0, "eval": 0}
        self.co = torch.zeros(E, E, dtype=torch.float64)                 # (E, E)
        self.by_token = torch.zeros(E * vocab_size, dtype=torch.long)    # (E*V,) expert-major
        self.text = torch.zeros(vocab_size, dtype=torch.long)            # (V,)

    @torch.no_grad()
    def add(self, ids: torch.Tensor, probs: torch.Tensor, expert_idx: torch.Tensor,
            num_samples: int = 1) -> None:
        """One forward's routing: ids (T,), probs (T, E), expert_idx (T, k), the T tokens being
        ``num_samples`` equal sequences."""
        E, V = self.moe.num_experts, self.vocab_size
        ids, probs, expert_idx = ids.cpu(), probs.float().cpu(), expert_idx.cpu()
        T = ids.numel()
        self.tokens += T
        self.entropy_sum += float(-(probs * probs.clamp_min(1e-20).log()).sum())
        chosen = torch.zeros(T, E, dtype=torch.float64).scatter_(1, expert_idx, 1.0)   # (T, E)
        self.co += chosen.T @ chosen
        self.by_token += torch.bincount((expert_idx * V + ids[:, None]).flatten(),
                                        minlength=E * V)
        self.text += torch.bincount(ids, minlength=V)
        parts = self.ep if num_samples % self.ep == 0 else 1
        for part in expert_idx.chunk(parts):                             # each ep rank's tokens
            for mode, training in (("train", True), ("eval", False)):
                capacity = self.moe.capacity(part.shape[0], training)
                if capacity is not None:
                    self.dropped[mode] += int(plan_dispatch(part, E, capacity).num_dropped)

    def summary(self, block: int, vocab: list[str]) -> dict:
        """The layer's report entry (``block``: its transformer block index)."""
        E, k, T = self.moe.num_experts, self.moe.top_k, max(self.tokens, 1)
        counts = self.co.diagonal().round().long()                       # (E,) = tokens_per_expert
        load = counts.double() / max(int(counts.sum()), 1)
        load_entropy = float(-(load * load.clamp_min(1e-300).log()).sum())
        by_token = self.by_token.view(E, self.vocab_size)                 # (E, V)
        text_share = self.text.double() / T                              # (V,)
        classes = [token_class(s) for s in vocab]
        class_of = torch.tensor([CLASSES.index(c) for c in classes])     # (V,)
        text_classes = torch.zeros(len(CLASSES), dtype=torch.float64).index_add_(
            0, class_of, self.text.double()) / T
        experts = []
        for e in range(E):
            n = max(int(counts[e]), 1)
            share = by_token[e].double() / n                             # (V,)
            lift = torch.where(self.text > 0, share / text_share.clamp_min(1e-300),
                               torch.zeros_like(share))
            by_count = by_token[e].argsort(descending=True, stable=True)   # (V,) most taken first
            most = by_count[:TOP_TOKENS]
            eligible = torch.where((self.text >= MIN_TEXT_COUNT) & (by_token[e] > 0), lift,
                                   torch.full_like(lift, -1.0))
            ranked = by_count[eligible[by_count].argsort(descending=True, stable=True)]
            distinct = [i for i in ranked[:TOP_TOKENS] if eligible[i] > 0]
            cls = torch.zeros(len(CLASSES), dtype=torch.float64).index_add_(
                0, class_of, by_token[e].double()) / n
            experts.append({
                "expert": e,
                "share_of_uniform": float(counts[e]) * E / (k * T),
                "top_tokens": [_token(i, by_token[e], self.text, T, vocab)
                               for i in most.tolist() if by_token[e][i] > 0],
                "distinctive_tokens": [_token(int(i), by_token[e], self.text, T, vocab)
                                       for i in distinct],
                "classes": {c: {"share": float(cls[j]), "text_share": float(text_classes[j]),
                                "lift": float(cls[j] / text_classes[j])}
                            for j, c in enumerate(CLASSES) if text_classes[j] > 0}})
        return {
            "block": block,
            "tokens": self.tokens,
            "tokens_per_expert": counts.tolist(),
            "load_max_over_mean": float(counts.max()) / max(float(counts.double().mean()), 1e-9),
            "router_entropy": self.entropy_sum / T,
            "load_entropy": load_entropy,
            "max_entropy": math.log(E),
            "dropped_frac_train_cf": self.dropped["train"] / (k * T),
            "dropped_frac_eval_cf": self.dropped["eval"] / (k * T),
            "co_selection": self.co.round().long().tolist(),
            "experts": experts}


def _token(i: int, counts: torch.Tensor, text: torch.Tensor, tokens: int, vocab) -> dict:
    """Token id ``i`` at one expert: its assignments there (``count``), their share of the
    expert's, the id's share of the ``tokens`` of the text, the lift, and ``routed_frac``: the
    fraction of the id's occurrences routed there (1 = always, where the lift reaches its
    ceiling, tokens / the expert's count)."""
    count, seen, total = int(counts[i]), int(text[i]), max(int(counts.sum()), 1)
    share, text_share = count / total, seen / tokens
    return {"id": i, "text": vocab[i], "count": count, "share": share, "text_share": text_share,
            "lift": share / text_share if seen else 0.0, "routed_frac": count / max(seen, 1)}


@contextmanager
def captured_routing(model):
    """Within the block, ``calls`` (yielded) collects each MoE router's outputs per forward:
    {block index: (probs (T, E), expert_idx (T, k))}, one dict per forward."""
    calls: list[dict] = []
    handles = []

    def hook_for(block: int):
        def hook(module, inputs, outputs):
            _, probs, expert_idx, _ = outputs
            if not calls or block in calls[-1]:
                calls.append({})
            calls[-1][block] = (probs.detach(), expert_idx.detach())
        return hook

    for i, layer in enumerate(model.layers):
        if layer.is_moe:
            handles.append(layer.mlp.gate.register_forward_hook(hook_for(i)))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def analyze_model(model, batches: list[torch.Tensor], vocab: list[str], ep: int = 1,
                  device: str = "cpu") -> dict:
    """Run ``model`` (eval mode) over ``batches`` of token ids (b, S) and return
    ``{"tokens", "layers", "collapsed"}`` for its MoE layers (see module docstring)."""
    cfg = model.cfg
    blocks = [i for i, layer in enumerate(model.layers) if layer.is_moe]
    stats = {b: LayerStats(cfg.moe, cfg.vocab_size, ep) for b in blocks}
    model.eval().to(device)
    with captured_routing(model) as calls:
        for ids in batches:
            calls.clear()
            model(ids.to(device))
            for block, (probs, expert_idx) in calls[0].items():
                stats[block].add(ids.reshape(-1), probs, expert_idx, num_samples=ids.shape[0])
    layers = [stats[b].summary(b, vocab) for b in blocks]
    return {"tokens": layers[0]["tokens"] if layers else 0, "layers": layers,
            "collapsed": collapsed(layers)}


def collapsed(layers: list[dict]) -> dict:
    """The experts below ``EXPERT_COLLAPSE`` x uniform load and the layers whose load entropy
    is below ``LAYER_COLLAPSE`` x ln E."""
    experts = [{"block": L["block"], "expert": x["expert"],
                "share_of_uniform": x["share_of_uniform"]}
               for L in layers for x in L["experts"] if x["share_of_uniform"] < EXPERT_COLLAPSE]
    low = [{"block": L["block"], "load_entropy": L["load_entropy"],
            "load_entropy_ratio": L["load_entropy"] / L["max_entropy"]}
           for L in layers if L["load_entropy"] < LAYER_COLLAPSE * L["max_entropy"]]
    return {"experts": experts, "layers": low}


def report(meta: dict, entries: list[dict]) -> dict:
    """The whole report: ``meta`` (run, text, model), the thresholds, one entry per checkpoint
    (``tag``, ``step``, ``tokens``, ``layers``, ``collapsed``), and the last entry's
    ``tokens``, ``layers`` and ``collapsed`` at the top level."""
    last = entries[-1]
    return {**meta,
            "thresholds": {"expert_share_of_uniform": EXPERT_COLLAPSE,
                           "load_entropy_over_ln_experts": LAYER_COLLAPSE,
                           "min_text_count_for_lift_ranking": MIN_TEXT_COUNT},
            "checkpoint": last["tag"], "step": last["step"], "tokens": last["tokens"],
            "layers": last["layers"], "collapsed": last["collapsed"],
            "checkpoints": entries}
