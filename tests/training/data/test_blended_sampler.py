"""training/data/batches.py's BlendedSampler and validation windows on synthetic token streams: a step's
tokens do not depend on micro-batch, accumulation or data-parallel size; a resume continues the
same order; epochs cover every window once; a 0.7 / 0.3 blend holds its shares; the validation
batches do not depend on the layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_pipeline.sampling import TokenStream
from model.transformer import IGNORE_INDEX
from training.data.batches import (BatchLayout, BlendedSampler, blended_validation_windows, text_windows, validation_batches)


def _stream(start: int, n: int, dtype=np.uint16, pieces: int = 1) -> TokenStream:
    """Tokens start, start+1, ... in ``pieces`` segments of one array (as shards would be)."""
    tokens = np.arange(start, start + n, dtype=dtype)
    cuts = np.linspace(0, n, pieces + 1).astype(int)
    return TokenStream(tuple((tokens, int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:])))


def _step_rows(sampler: BlendedSampler, step: int) -> torch.Tensor:
    return torch.cat([ids for ids, _ in sampler.batches_for_step(step)])


def test_step_tokens_do_not_depend_on_micro_accumulation_or_dp():
    streams, names = [_stream(0, 5000, pieces=3), _stream(10_000, 3000)], ["a", "b"]
    ref = BlendedSampler(streams, names, [0.6, 0.4], 16, BatchLayout(8, 8), seed=1)
    for micro, dp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 2)):
        per_rank = [BlendedSampler(streams, names, [0.6, 0.4], 16, BatchLayout(8, micro, dp, r), seed=1)
                    for r in range(dp)]
        for step in (0, 3, 17):
            assert len(per_rank[0].batches_for_step(step)) == 8 // (micro * dp)
            got = torch.cat([_step_rows(s, step) for s in per_rank])
            assert torch.equal(got, _step_rows(ref, step)), (micro, dp, step)
    ids, labels = ref.batches_for_step(0)[0]
    assert torch.equal(ids[:, 1:], labels[:, :-1])          # labels are the next tokens


def test_a_resumed_sampler_continues_the_same_order_and_refuses_other_settings():
    streams, names, layout = [_stream(0, 4000), _stream(50_000, 4000)], ["a", "b"], BatchLayout(4, 2)
    straight = BlendedSampler(streams, names, None, 16, layout, seed=5)
    first = BlendedSampler(streams, names, None, 16, layout, seed=5)
    first.step = 7
    resumed = BlendedSampler(streams, names, None, 16, layout, seed=5)
    resumed.load_state_dict(first.state_dict())
    assert resumed.step == 7
    for step in range(7, 12):
        assert torch.equal(_step_rows(resumed, step), _step_rows(straight, step))
    state = first.state_dict()
    assert state["tokens_by_source"] == straight.tokens_by_source(7)
    for other in (BlendedSampler(streams, names, None, 16, layout, seed=6),
                  BlendedSampler(streams, names, [0.5, 0.5], 16, layout, seed=5),
                  BlendedSampler(streams, ["a", "c"], None, 16, layout, seed=5),
                  BlendedSampler(streams[:1], names[:1], None, 16, layout, seed=5),
                  BlendedSampler(streams, names, None, 8, layout, seed=5),
                  BlendedSampler(streams, names, None, 16, BatchLayout(8, 2), seed=5)):
        with pytest.raises(ValueError, match="cannot resume the data order"):
            other.load_state_dict(state)


def test_one_source_visits_every_window_once_per_epoch_and_reshuffles():
    seq, n_windows = 8, 60
    stream = _stream(0, n_windows * seq + 1)
    sampler = BlendedSampler([stream], ["only"], None, seq, BatchLayout(6, 6), seed=2)
    assert sampler.windows == [n_windows]
    epochs = []
    for epoch in range(2):
        firsts = torch.cat([_step_rows(sampler, s)[:, 0] for s in range(epoch * 10, epoch * 10 + 10)])
        assert sorted((firsts // seq).tolist()) == list(range(n_windows)), epoch
        epochs.append(firsts)
    assert not torch.equal(epochs[0], epochs[1])
    assert sampler.tokens_by_source(10) == {"only": 10 * 6 * seq}


def test_a_07_03_blend_holds_its_shares_over_10000_sequences():
    a, b = _stream(0, 20_000), _stream(100_000, 200_000, dtype=np.uint32)
    sampler = BlendedSampler([a, b], ["A", "B"], [0.7, 0.3], 16, BatchLayout(100, 100), seed=0)
    firsts = torch.cat([_step_rows(sampler, s)[:, 0] for s in range(100)])        # 10,000 sequences
    from_a = (firsts < 100_000).float().mean().item()
    assert abs(from_a - 0.7) < 0.01
    seen = sampler.tokens_by_source(100)
    assert seen == {"A": int((firsts < 100_000).sum()) * 16, "B": int((firsts >= 100_000).sum()) * 16}
    # A's 1,249 windows are far fewer than its 7,000 samples: it repeats, epoch after epoch.
    assert sampler.windows[0] == (20_000 - 1) // 16 and sampler.epoch == 0    # B's epoch: the largest


def test_without_weights_each_source_counts_by_its_windows():
    sampler = BlendedSampler([_stream(0, 3000), _stream(9000, 1000)], ["big", "small"], None, 10,
                             BatchLayout(40, 40), seed=0)
    assert sampler.weights == (299.0, 99.0)
    seen = sampler.tokens_by_source(100)
    assert abs(seen["big"] / (seen["big"] + seen["small"]) - 299 / 398) < 0.01


def test_a_source_shorter_than_one_window_is_named():
    with pytest.raises(ValueError, match="data.source entry 'tiny' has 5 training tokens"):
        BlendedSampler([_stream(0, 1000), _stream(0, 5)], ["big", "tiny"], None, 16, BatchLayout(1, 1), 0)


def test_validation_batches_fixed_padded_and_layout_independent():
    seq = 8
    streams = [_stream(0, 75), _stream(1000, 30)]
    windows = blended_validation_windows(streams, None, seq, 9)
    assert windows.shape == (9, seq + 1)
    again = blended_validation_windows(streams, None, seq, 9)
    assert np.array_equal(windows, again)
    def real_rows(batches):
        return [(i, l) for ids, labs in batches for i, l in zip(ids, labs) if (l != IGNORE_INDEX).any()]

    reference = real_rows(validation_batches(windows, BatchLayout(2, 2)))
    assert len(reference) == 9
    for dp, micro in ((2, 1), (2, 2), (3, 2), (4, 1)):
        parts = [validation_batches(windows, BatchLayout(dp * micro, micro, dp, r)) for r in range(dp)]
        assert len({len(part) for part in parts}) == 1          # every rank runs the same forwards
        rows = [row for part in parts for row in real_rows(part)]
        assert len(rows) == 9 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                      for a, b in zip(rows, reference)), (dp, micro)
    # The short last window of a stream: its missing labels are ignored, not token 0.
    tail = validation_batches(text_windows(np.arange(20, dtype=np.uint16), seq), BatchLayout(3, 3))
    ids, labels = tail[0]
    assert labels[-1].tolist() == [17, 18, 19] + [IGNORE_INDEX] * 5
    # One window over two ranks at micro 1: rank 1 gets a single padding row, whose inputs are
    # token ids (0), never the labels' IGNORE_INDEX.
    for rank in range(2):
        (ids, labels), = validation_batches(windows[:1], BatchLayout(2, 1, 2, rank))
        assert ids.min() >= 0, rank
        assert (labels == IGNORE_INDEX).all() == (rank == 1)


def test_batch_layout_validation():
    with pytest.raises(ValueError, match=r"train_batch_size \(6\).*\(1\) x .*\(4\) = 4.*fix"):
        BatchLayout(6, 4)
    with pytest.raises(ValueError, match=r"data-parallel size \(4\)"):
        BatchLayout(8, 4, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank"):
        BatchLayout(8, 2, dp_size=2, dp_rank=2)
    assert BatchLayout(16, 2, dp_size=2).grad_accum_steps == 4
    with pytest.raises(ValueError, match="seq_len"):
        BlendedSampler([_stream(0, 100)], ["a"], None, 0, BatchLayout(1, 1), seed=0)
