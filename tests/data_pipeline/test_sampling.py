"""data_pipeline/sampling.py: the keyed permutation is a bijection, the blend's running counts are
exact and its shares hold over every prefix, and windows read across segment boundaries."""

from __future__ import annotations

import random

import numpy as np
import pytest

from data_pipeline import sampling


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 1000, 4097, 65537])
def test_permute_is_a_bijection_for_every_key(n):
    for key in (0, 1, sampling.stable_key("x", 7)):
        perm = sampling.permute(np.arange(n), n, key)
        assert np.array_equal(np.sort(perm), np.arange(n)), (n, key)


def test_permute_depends_on_the_key_and_shuffles():
    a, b = (sampling.permute(np.arange(10_000), 10_000, k) for k in (1, 2))
    assert not np.array_equal(a, b)
    # A shuffle, not a rotation: few fixed points and no long run of consecutive values.
    assert (a == np.arange(10_000)).sum() < 10
    assert (np.diff(a) == 1).mean() < 0.01
    # A value's image does not depend on which other values are asked for with it.
    assert np.array_equal(sampling.permute(np.array([5, 9999]), 10_000, 1), a[[5, 9999]])


def test_count_below_equals_a_brute_force_count():
    rng = random.Random(0)
    for _ in range(300):
        count, offset, threshold = rng.randint(0, 2000), rng.randrange(sampling._M), rng.randint(0, sampling._M)
        brute = sum((p * sampling._A + offset) % sampling._M < threshold for p in range(count))
        assert sampling._count_below(count, offset, threshold) == brute


def test_blend_shares_hold_over_every_prefix_and_counts_are_exact():
    blend = sampling.Blend.of([0.7, 0.3], seed=3)
    dataset, k = blend.assign(0, 10_000)
    assert abs((dataset == 0).mean() - 0.7) < 0.001
    running = np.cumsum(np.eye(2, dtype=np.int64)[dataset], axis=0)
    # Low discrepancy: every prefix holds each share to a few samples (measured 2.7 here).
    assert np.abs(running - np.outer(np.arange(1, 10_001), blend.weights)).max() < 5
    for d in (0, 1):                      # each dataset's samples are numbered 0, 1, 2, ... in order
        assert np.array_equal(k[dataset == d], np.arange((dataset == d).sum()))
    assert np.array_equal(blend.counts(10_000), running[-1])
    # Any window of positions gives the same assignment as the whole run: a step needs no history.
    d2, k2 = blend.assign(6_543, 7_777)
    assert np.array_equal(d2, dataset[6_543:7_777]) and np.array_equal(k2, k[6_543:7_777])


def test_blend_of_three_normalizes_and_refuses_bad_weights():
    blend = sampling.Blend.of([2, 1, 1])
    assert blend.weights == (0.5, 0.25, 0.25)
    assert list(blend.counts(4000)) == pytest.approx([2000, 1000, 1000], abs=4)
    for bad in ([], [1, 0], [1, -2], [float("nan")], [float("inf"), 1]):
        with pytest.raises(ValueError):
            sampling.Blend.of(bad)


def test_token_stream_windows_cross_segments_and_mark_the_short_tail():
    a, b = np.arange(100, 110, dtype=np.uint16), np.arange(200, 207, dtype=np.uint16)
    stream = sampling.TokenStream(((a, 2, 10), (b, 0, 7)))     # 102..109, 200..206: 15 tokens
    assert stream.num_tokens == 15 and stream.num_windows(4) == 3 and stream.num_windows(4, True) == 4
    w = stream.windows(np.array([0, 1, 2]), 4)
    assert w[0].tolist() == [102, 103, 104, 105, 106]
    assert w[1].tolist() == [106, 107, 108, 109, 200]          # across the boundary
    assert w[2].tolist() == [200, 201, 202, 203, 204]
    tail = stream.windows(np.array([2]), 6)[0]                 # positions 12..18: 3 real tokens
    assert tail.tolist() == [204, 205, 206, -1, -1, -1, -1]


def test_reading_windows_far_apart_touches_only_their_tokens(tmp_path):
    """Two windows at the two ends of a 40 MB shard: the read allocates little (1.3 MB measured), not
    the span between them (a slice from the first to the last would copy 160 MB as int64)."""
    import tracemalloc

    from data_pipeline.sampling import TokenStream
    n = 20_000_000
    path = tmp_path / "t.bin"
    np.arange(n, dtype=np.uint32).astype(np.uint16).tofile(path)
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    stream = TokenStream(((tokens, 0, n),))
    index = np.array([0, n // 64 - 1])
    tracemalloc.start()
    windows = stream.windows(index, 63)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    expected = (index[:, None] * 63 + np.arange(64)) % 65536
    assert np.array_equal(windows, expected)
    assert peak < 16_000_000, peak                 # measured 1.3 MB; the span would be 160 MB
