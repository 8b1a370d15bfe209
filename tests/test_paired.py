"""``crosskd.paired``: the paired bootstrap over documents of two models' held-out bits per
byte, checked on values worked out by hand and against a direct resampling loop."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from crosskd.errors import ConfigError
from crosskd.paired import paired_bootstrap


def test_a_model_against_itself_differs_by_nothing():
    bits, n_bytes = [10.0, 4.0, 7.5], [5, 4, 3]
    d = paired_bootstrap(bits, n_bytes, bits, n_bytes, samples=200)
    assert (d.difference, d.low, d.high, d.p_value) == (0.0, 0.0, 0.0, 1.0)
    assert (d.documents, d.seeds, d.samples) == (3, 1, 200)


def test_one_bit_less_on_every_document_by_hand():
    """``a`` spends one bit less than ``b`` on each of 3 documents of 4 bytes: ``bpb_a - bpb_b
    = -3 / 12`` on every resample, so the interval is that point, and no resample reaches zero:
    p = 2 * (0 + 1) / (samples + 1)."""
    bits_b = np.array([8.0, 12.0, 4.0])
    n_bytes = np.array([4, 4, 4])
    d = paired_bootstrap(bits_b - 1, n_bytes, bits_b, n_bytes, samples=99)
    assert d.difference == pytest.approx(-0.25)
    assert d.low == pytest.approx(-0.25) and d.high == pytest.approx(-0.25)
    assert d.relative == pytest.approx(-0.25 / 2.0)
    assert d.p_value == pytest.approx(2 / 100)


def test_seeds_are_averaged_and_resampled_together():
    """Two seeds: ``a`` better by 0.5 bits per byte on seed 0 and worse by 0.25 on seed 1, on
    documents of equal bytes: the mean difference is (-0.5 + 0.25) / 2 on every resample."""
    n_bytes = np.full((2, 4), 2)
    bits_b = np.array([[3.0, 5.0, 2.0, 6.0], [1.0, 1.0, 4.0, 2.0]])
    bits_a = bits_b + np.array([[-1.0], [0.5]])
    d = paired_bootstrap(bits_a, n_bytes, bits_b, n_bytes, samples=50)
    assert d.seeds == 2
    assert d.difference == pytest.approx(-0.125)
    assert d.low == pytest.approx(-0.125) and d.high == pytest.approx(-0.125)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(2, 12).flatmap(
        lambda n: st.tuples(
            st.lists(st.floats(0.1, 50), min_size=n, max_size=n),
            st.lists(st.floats(0.1, 50), min_size=n, max_size=n),
            st.lists(st.integers(1, 40), min_size=n, max_size=n),
            st.lists(st.integers(1, 40), min_size=n, max_size=n),
        )
    ),
    st.integers(0, 2**31),
)
def test_matches_a_direct_resampling_loop(arrays, seed):
    """Against a loop written from the definition, with the same draws: the interval's ends are
    quantiles of the same resampled differences, the point value the full-data difference, the
    p-value twice the share of resamples on the far side of zero."""
    bits_a, bits_b, bytes_a, bytes_b = (np.asarray(a, dtype=np.float64) for a in arrays)
    samples = 300
    d = paired_bootstrap(bits_a, bytes_a, bits_b, bytes_b, samples=samples, seed=seed)
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(bits_a), size=(samples, len(bits_a)))
    direct = [
        bits_a[i].sum() / bytes_a[i].sum() - bits_b[i].sum() / bytes_b[i].sum() for i in index
    ]
    assert d.low == pytest.approx(np.quantile(direct, 0.025), rel=1e-9, abs=1e-12)
    assert d.high == pytest.approx(np.quantile(direct, 0.975), rel=1e-9, abs=1e-12)
    full = bits_a.sum() / bytes_a.sum() - bits_b.sum() / bytes_b.sum()
    assert d.difference == pytest.approx(full, rel=1e-12, abs=1e-12)
    assert d.low <= d.high
    direct = np.asarray(direct)
    far = (direct >= 0).sum() if full < 0 else (direct <= 0).sum()
    assert d.p_value == pytest.approx(min(1.0, 2 * (far + 1) / (samples + 1)))


def test_a_real_difference_has_a_small_p_value_and_noise_a_large_one():
    rng = np.random.default_rng(1)
    n_bytes = rng.integers(200, 400, size=80)
    bits_b = n_bytes * rng.normal(2.0, 0.3, size=80)
    better = bits_b * (1 - 0.03 + rng.normal(0, 0.01, size=80))
    noisy = bits_b * (1 + rng.normal(0, 0.03, size=80))
    assert paired_bootstrap(better, n_bytes, bits_b, n_bytes).p_value < 0.001
    assert paired_bootstrap(noisy, n_bytes, bits_b, n_bytes).p_value > 0.05


@pytest.mark.parametrize(
    ("arrays", "words"),
    [
        (([1.0, 2.0], [1, 1], [1.0], [1]), "the same seeds and documents"),
        (([1.0], [0], [1.0], [1]), "a document has no bytes"),
        (([], [], [], []), "one value per document"),
    ],
)
def test_bad_inputs_are_refused_by_name(arrays, words):
    with pytest.raises(ConfigError, match=words):
        paired_bootstrap(*arrays)
