"""Document masking at every layout, on gloo ranks: a document's logits inside a packed window
equal its logits alone in the unsharded model, and the window's gradients equal the unsharded
model's, at TP2, TP2 + sequence parallelism, EP2 (``Transformer``), and through DeepSpeed's
pipeline engine at PP2, PP2 x TP2 + SP and PP2 x EP2 (``TransformerPipe``: the first stage
derives the document ids and the stages carry them with the hidden state).

One reference (``Transformer`` on one process, masking on) is built on every rank from the same
seed; each rank compares its rows (ep) and its vocabulary shard (tp) of the logits, and each
parameter's gradient with the reference gradient's slice (``take_shard``). The window is
``tests/model/test_document_masking.py``'s: five documents in one row (one of them a separator
alone), two in the other, labels kept inside each document.

Tolerance: fp32; the layouts change summation orders only (split matmuls, all-reduces,
all-to-alls, the pipeline back-propagating each stage output separately) and the window's
masked kernel differs from a document's alone (see the single-process test): 1e-5 absolute and
relative on O(1) logits and on the gradients of a loss averaged over the window's targets.
Launches: one of 2 ranks, one of 4 (8-12 s and 12-17 s on 2 cores).
"""

from __future__ import annotations

import os

import torch

from model import Transformer
from model.parallel.groups import build_groups
from model.parallel.layers import take_shard
from training.run.spawn import run_ranks
from tests.model.test_document_masking import TOL, alone, configs, packed_window


def _expected_logits(ref, ids, labels, docs, groups, rows):
    """{(row in this rank's slice, start, length): the reference's logits of that document
    alone, this rank's vocabulary shard}."""
    vocab = ref.cfg.vocab_size // groups.tp
    shard = slice(groups.tp_rank * vocab, (groups.tp_rank + 1) * vocab)
    with torch.no_grad():
        return {(r - rows.start, s, n): alone(ref, ids, labels, (r, s, n)).logits[0, :, shard]
                for r, s, n in docs if r in rows}


def _rows(groups, batch: int) -> range:
    part = batch // groups.ep
    return range(groups.ep_rank * part, (groups.ep_rank + 1) * part)


def _reference(cfg):
    """The unsharded model, its window, and its gradients of the window's mean ce (+ router)."""
    ref = Transformer(cfg, None, init_seed=7)
    ids, labels, docs = packed_window(cfg)
    targets = (labels != -100).sum().item()
    out = ref(ids, labels)
    (out.ce_sum / targets + ref.router_loss(out)).backward()
    return ref, ids, labels, docs, targets


def _check_grads(named_params, ref, tag, rename=lambda n: n):
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in named_params:
        expected = take_shard(ref_params[rename(name)].grad, p.shard_spec)
        torch.testing.assert_close(p.grad, expected, **TOL, msg=f"{tag} grad {name}")
        checked += 1
    assert checked, tag


def _check_model(cfg, groups, tag, checkpointing="none"):
    ref, ids, labels, docs, targets = _reference(cfg)
    par = Transformer(cfg, groups, init_seed=7)
    par.set_activation_checkpointing(checkpointing)
    out = par(ids, labels)
    (out.ce_sum / targets + par.router_loss(out)).backward()
    for (r, s, n), want in _expected_logits(ref, ids, labels, docs, groups, _rows(groups, 2)).items():
        torch.testing.assert_close(out.logits[r, s:s + n], want, **TOL, msg=f"{tag} {(r, s, n)}")
    _check_grads(par.named_parameters(), ref, tag)


def _stage_name(name: str) -> str:
    # PipelineModule prefixes each layer's parameters with its index ("3.layers.2.mlp...") or,
    # for the tied embedding, "tied_modules.embed."; the rest is the Transformer's name.
    return name.split(".", 2)[2] if name.startswith("tied_modules.") else name.split(".", 1)[1]


def _check_pipeline(cfg, groups, tag):
    """DeepSpeed's engine on this rank's stage: the inference schedule's logits (last stage),
    then one 1F1B step whose gradients are read just before the optimizer step (lr 0)."""
    import deepspeed
    from training.engine.pipeline import TransformerPipe, before_optimizer_step, pipeline_ds_config
    ref, ids, labels, docs, targets = _reference(cfg)
    pipe = TransformerPipe(cfg, groups, seed=7)
    ds = pipeline_ds_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                             "train_batch_size": 2 * groups.dp, "gradient_clipping": 0.0,
                             "zero_optimization": {"stage": 0}, "steps_per_print": 10 ** 9})
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.0),
                                      config=ds)
    pipe.loss_fn.ce_scale = 1.0 / targets      # the loss is the reference's: mean ce + router
    _, outputs = engine.eval_batch(iter([(ids, labels)]), return_logits=True, num_micro_batches=1)
    if engine.is_last_stage():
        logits = outputs[0]                                               # (B/ep, S, V/tp)
        want = _expected_logits(ref, ids, labels, docs, groups, _rows(groups, 2))
        assert want, tag
        for (r, s, n), expected in want.items():
            torch.testing.assert_close(logits[r, s:s + n], expected, **TOL, msg=f"{tag} {(r, s, n)}")
    grads = {}
    before_optimizer_step(engine, lambda: grads.update(
        {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}))
    engine.train_batch(iter([(ids, labels)]))
    params = dict(pipe.named_parameters())
    assert grads.keys() == params.keys(), (tag, sorted(set(params) - set(grads)))
    for name, g in grads.items():
        params[name].grad = g
    _check_grads(params.items(), ref, tag, _stage_name)


def _setup(rank, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")        # as the trainer does


def _two_ranks(rank, world):
    _setup(rank, world)
    cfgs = configs()
    tp2 = build_groups(tp=2)
    for name in ("dense", "qwen3", "dense_tied_1kv"):
        _check_model(cfgs[name], tp2, f"tp2/{name}")
    sp = build_groups(tp=2, sequence_parallel=True)
    for name, cfg in cfgs.items():
        _check_model(cfg, sp, f"tp2-sp/{name}")
    _check_model(cfgs["mixtral"], sp, "tp2-sp/mixtral/full-checkpointing", "full")
    ep2 = build_groups(ep=2)
    for name in ("mixtral", "dense_tied_1kv"):
        _check_model(cfgs[name], ep2, f"ep2/{name}")
    pp2 = build_groups(pp=2)
    _check_pipeline(cfgs["mixtral"], pp2, "pp2/mixtral")


def _four_ranks(rank, world):
    _setup(rank, world)
    cfgs = configs()
    _check_pipeline(cfgs["qwen3"], build_groups(tp=2, pp=2, sequence_parallel=True), "pp2xtp2-sp/qwen3")
    _check_pipeline(cfgs["mixtral"], build_groups(ep=2, pp=2), "pp2xep2/mixtral")


def test_document_masking_at_tp2_sp_ep2_and_pp2():
    run_ranks(_two_ranks, 2)


def test_document_masking_through_pipeline_stages_with_tp_sp_and_ep():
    run_ranks(_four_ranks, 4)
