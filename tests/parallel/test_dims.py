"""The one layout validator (model/parallel/dims.py): every degree checked up front, one line each
naming the field, the value and the fix; and the DeepSpeed-dependent checks beside it
(training.config.ds_config.check_layout). Single process, no torch.distributed."""

import re
from dataclasses import replace

import pytest

from model.config import DenseConfig, MixtralConfig, MoEConfig
from model.parallel.dims import ParallelDims
from training.config.ds_config import check_layout

MIXTRAL = MixtralConfig(vocab_size=96, hidden_size=64, num_layers=4, num_heads=8, num_kv_heads=2,
                        ffn_hidden_size=96, max_seq_len=64,
                        moe=MoEConfig(num_experts=8, top_k=2)).validate()


def test_degrees_world_and_data_parallel_size():
    dims = ParallelDims(tp=2, ep=4, pp=2, world_size=32, model=MIXTRAL, seq_len=64)
    assert dims.dp == 2 and dims.problems() == []
    assert ParallelDims(world_size=3).dp == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=0), r"parallel\.tensor_parallel_size \(0\) must be an integer >= 1"),
    (dict(ep=True), r"parallel\.expert_parallel_size \(True\) must be an integer >= 1"),
    (dict(tp=2, world_size=3), r"world size \(3\) is not divisible by .* \(2 x 1 x 1 x 1 = 2\): launch a "
                               r"multiple of 2 processes"),
    (dict(tp=3, model=MIXTRAL), r"parallel\.tensor_parallel_size \(3\) does not divide "
                                r"model\.num_heads \(8\): choose a divisor of 8"),
    (dict(tp=4, model=replace(MIXTRAL, ffn_hidden_size=98)), r"parallel\.tensor_parallel_size "
                                                             r"\(4\) does not divide model\.ffn_hidden_size \(98\)"),
    (dict(tp=4, model=replace(MIXTRAL, vocab_size=98)), r"parallel\.tensor_parallel_size \(4\) "
                                                        r"does not divide model\.vocab_size \(98\)"),
    (dict(ep=3, model=MIXTRAL), r"parallel\.expert_parallel_size \(3\) does not divide "
                                r"model\.moe\.num_experts \(8\)"),
    (dict(ep=2, model=DenseConfig(num_layers=2)), r"expert_parallel_size \(2\) must be 1 for "
                                                  r"model\.family dense"),
    (dict(pp=5, model=MIXTRAL), r"parallel\.pipeline_parallel_size \(5\) exceeds model\.num_layers \(4\)"),
    (dict(tp=2, sp=True, seq_len=63), r"data\.seq_len \(63\) is not divisible by "
                                      r"parallel\.tensor_parallel_size \(2\): sequence parallelism"),
])
def test_each_problem_is_one_line_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        ParallelDims(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(cp=0), r"parallel\.context_parallel_size \(0\) must be an integer >= 1"),
    (dict(cp=2, seq_len=62), r"data\.seq_len \(62\) is not divisible by 4 for "
                             r"parallel\.context_parallel_size \(2\) \(2 x cp chunks\): use a multiple of 4"),
    # SP splits each rank's S/cp = 44 tokens over tp 8: 88 is refused (96 would do).
    (dict(cp=2, tp=8, sp=True, seq_len=88, cp_comm="p2p", model=replace(MIXTRAL, vocab_size=128)),
     r"data\.seq_len \(88\) is not divisible by 16 for parallel\.context_parallel_size \(2\) "
     r"\(2 x cp chunks, each rank's S/cp split over tp = 8\)"),
    (dict(cp=3, model=MIXTRAL), r"parallel\.context_parallel_size \(3\) does not divide the query "
                                r"heads per tp rank \(model\.num_heads 8 / tp 1\) for parallel\.cp_comm "
                                r"a2a: use cp_comm allgather or p2p"),
    (dict(cp=4, tp=4, model=replace(MIXTRAL, vocab_size=128)), r"does not divide the query heads per "
                                                               r"tp rank \(model\.num_heads 8 / tp 4\)"),
    (dict(cp=2, cp_comm="ring"), r"parallel\.cp_comm \('ring'\) must be one of a2a, allgather, p2p"),
    (dict(cp=2, tp=2, world_size=6), r"world size \(6\) is not divisible by .* \(2 x 1 x 2 x 1 = 4\)"),
])
def test_context_parallel_refusals_are_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        ParallelDims(**kwargs)
    assert "\n" not in str(info.value)


def test_context_parallel_degrees_that_work():
    """cp takes its share of the world; any cp with allgather and p2p (3 does not divide 8 heads);
    a2a with GQA's kv heads fewer than cp (repeated, see ``ulysses_attention``); SP at the lcm;
    pipeline stages and MTP."""
    dims = ParallelDims(tp=2, ep=2, cp=2, world_size=16, model=MIXTRAL, seq_len=64)
    assert dims.dp == 2 and dims.problems() == []
    for comm in ("allgather", "p2p"):
        ParallelDims(cp=3, cp_comm=comm, model=MIXTRAL, seq_len=66)
    ParallelDims(cp=4, model=MIXTRAL, seq_len=64)           # 2 kv heads, cp 4: a2a repeats them
    ParallelDims(cp=2, tp=2, sp=True, model=MIXTRAL, seq_len=4)     # S/cp = 2, split over tp 2
    # Pipeline stages and MTP compose with cp (tests/parallel/test_context_parallel_layouts.py).
    dims = ParallelDims(cp=2, pp=2, world_size=8, model=replace(MIXTRAL, mtp_depth=2), seq_len=64)
    assert dims.dp == 2 and dims.problems() == []


def test_kv_heads_split_or_replicated():
    for tp in (1, 2, 4, 8):       # 2 kv heads: split over 1-2 ranks, replicated over 4-8
        ParallelDims(tp=tp, model=replace(MIXTRAL, vocab_size=128))
    cfg = DenseConfig(hidden_size=192, num_layers=2, num_heads=12, num_kv_heads=4,
                      ffn_hidden_size=384, vocab_size=384)
    with pytest.raises(ValueError, match=re.escape("choose tensor_parallel_size in [1, 2, 4, 12]")):
        ParallelDims(tp=6, model=cfg)


@pytest.mark.parametrize("ds, dims, message", [
    (dict(train_micro_batch_size_per_gpu=3), ParallelDims(ep=2),
     r"train_micro_batch_size_per_gpu \(3\) is not divisible by parallel\.expert_parallel_size \(2\)"),
    (dict(train_micro_batch_size_per_gpu=2, bf16={"enabled": True}), ParallelDims(tp=2),
     r"ZeRO-0 with bf16/fp16 reports a wrong gradient norm"),
    (dict(train_micro_batch_size_per_gpu=2, zero_optimization={"stage": 2}), ParallelDims(pp=2),
     r"zero_optimization\.stage \(2\) with parallel\.pipeline_parallel_size \(2\)"),
])
def test_deepspeed_dependent_checks(ds, dims, message):
    with pytest.raises(ValueError, match=message):
        check_layout(ds, dims)
    check_layout({**ds, "train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 1}},
                 dims)
