"""bfedjax.order_statistics: the k-th smallest value and the median without a sort, against numpy's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from bfedjax.order_statistics import (column_kept_ranks, column_kth_smallest, column_median, column_trimmed_mean,
                                      kth_smallest, kth_smallest_pair, median)

_kth = jax.jit(kth_smallest)
_median = jax.jit(median)
_floats = st.floats(width=32, allow_nan=False, allow_subnormal=True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(np.float32, st.integers(1, 40), elements=_floats), st.data())
def test_kth_smallest_is_the_sorted_value(x, data):
    k = data.draw(st.integers(0, x.size - 1))
    got = np.asarray(_kth(x, k))
    assert got == np.sort(x)[k]  # -0.0 == +0.0: which zero comes first is not specified


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(np.float32, st.integers(2, 40), elements=_floats | st.sampled_from([0.0, 1.0, np.inf])), st.data())
def test_kth_smallest_pair_is_the_two_sorted_neighbours(x, data):  # ties (0, 1, inf drawn often) repeat x_(k)
    k = data.draw(st.integers(0, x.size - 2))
    got = jax.jit(kth_smallest_pair)(x, k)
    np.testing.assert_array_equal(np.asarray(got), np.sort(x)[k:k + 2])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(np.float32, st.integers(1, 40), elements=st.floats(-1e6, 1e6, width=32) | st.sampled_from([0.0, 1.0])))
def test_median_is_numpys(x):  # ties (0 and 1 drawn often), odd and even counts
    # the mean of two different subnormal middles is flushed to zero on XLA:CPU: atol of the smallest normal
    np.testing.assert_allclose(_median(x), np.median(x), rtol=1e-6, atol=np.finfo(np.float32).tiny)


def test_a_single_or_repeated_middle_value_is_returned_exactly():
    tiny = np.float32(1.17292e-39)  # subnormal: (a + a) / 2 on XLA:CPU would flush it to 0 (Hypothesis found it)
    for x in ([tiny], [tiny, tiny], [-1.0, tiny, tiny, 5.0], [tiny, 3.0, -2.0]):
        assert np.asarray(_median(np.asarray(x, np.float32))) == np.median(np.asarray(x, np.float32)), x
    np.testing.assert_array_equal(column_median(jnp.asarray([[tiny], [tiny], [2.0]])), [tiny])


def test_median_of_a_large_vector_equals_jnp_median():
    x = jax.random.lognormal(jax.random.PRNGKey(0), shape=(199_210,))  # the MLP's precision count
    assert float(_median(x)) == float(jnp.median(x))
    assert float(_median(x[:-1])) == pytest.approx(float(jnp.median(x[:-1])), rel=1e-7)


def test_nans_sort_last_and_poison_the_median():
    x = jnp.asarray([3.0, jnp.nan, -1.0, -jnp.nan, 2.0])
    assert float(_kth(x, 2)) == 3.0 and np.isnan(_kth(x, 3)) and np.isnan(_median(x))
    assert float(_kth(jnp.asarray([-jnp.inf, jnp.inf, 0.0]), 2)) == np.inf


def test_traced_k_under_vmap_and_other_widths():
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 50))
    ks = jnp.asarray([0, 17, 49])
    np.testing.assert_array_equal(jax.jit(jax.vmap(kth_smallest))(x, ks), np.sort(np.asarray(x), axis=1)[[0, 1, 2], ks])
    half = x[0].astype(jnp.bfloat16)
    assert kth_smallest(half, 5) == jnp.sort(half)[5] and kth_smallest(half, 5).dtype == jnp.bfloat16
    small = np.random.default_rng(0).normal(size=11).astype(np.float16)  # 16-bit keys
    assert kth_smallest(small, 3) == np.sort(small)[3] and median(small) == np.median(small)
    with jax.enable_x64(True):  # 64-bit keys
        wide = np.random.default_rng(1).normal(size=100)
        assert kth_smallest(wide, 7) == np.sort(wide)[7] and median(wide) == np.median(wide)
        assert median(wide).dtype == jnp.float64


def test_bad_input_is_a_one_line_error():
    with pytest.raises(ValueError, match="fix: 0 <= k < 3"):
        kth_smallest(jnp.ones(3), 3)
    with pytest.raises(ValueError, match="fix: 0 <= k < 2"):
        kth_smallest_pair(jnp.ones(3), 2)
    with pytest.raises(ValueError, match="fix: cast it"):
        median(jnp.arange(4))
    with pytest.raises(ValueError, match="empty"):
        median(jnp.zeros(0))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 9), st.integers(1, 4), st.integers(1, 3)),
                  elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)  # XLA:CPU flushes them in sums
                  | st.sampled_from([-2.0, 0.0, 1.0])), st.data())
def test_column_statistics_are_numpys_over_the_real_rows(x, data):
    """Per coordinate over the rows where the mask is on (ties drawn often): the k-th smallest, the median and
    the trimmed mean, against numpy's sort of those rows."""
    c = x.shape[0]
    mask = np.asarray(data.draw(st.lists(st.booleans(), min_size=c, max_size=c).filter(any)), np.float32)
    real = np.sort(x[mask > 0], axis=0)
    k = real.shape[0]
    rank, drop = data.draw(st.integers(0, k - 1)), data.draw(st.integers(0, (k - 1) // 2))
    np.testing.assert_array_equal(jax.jit(column_kth_smallest)(x, rank, mask), real[rank])
    np.testing.assert_array_equal(jax.jit(column_median)(x, mask), np.median(real, axis=0))
    np.testing.assert_allclose(jax.jit(column_trimmed_mean)(x, mask, drop), real[drop:k - drop].mean(0), rtol=1e-5,
                               atol=1e-4)


def test_column_statistics_of_no_real_row_and_bad_input():
    x = jnp.arange(6.0).reshape(3, 2)
    assert np.all(np.isinf(column_median(x, jnp.zeros(3)))) and np.all(np.isinf(column_trimmed_mean(x, jnp.zeros(3), 0)))
    np.testing.assert_array_equal(column_median(x), [2.0, 3.0])  # no mask: every row
    with pytest.raises(ValueError, match="fix: stack the rows"):
        column_median(jnp.zeros((0, 3)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 9), st.integers(1, 5)),
                  elements=st.sampled_from([-1.0, -0.0, 0.0, 2.0]) | st.floats(-10, 10, width=32)), st.data())
def test_column_kept_ranks_are_a_stable_sorts(x, data):
    c = x.shape[0]
    mask = np.asarray(data.draw(st.lists(st.booleans(), min_size=c, max_size=c).filter(any)), np.float32)
    k = int(mask.sum())
    drop = data.draw(st.integers(0, (k - 1) // 2))
    real = (mask > 0)[:, None]
    rank = np.argsort(np.argsort(np.where(real, x, np.inf), axis=0, kind="stable"), axis=0, kind="stable")
    np.testing.assert_array_equal(jax.jit(column_kept_ranks)(x, mask, drop), real & (rank >= drop) & (rank < k - drop))


def test_kept_ranks_order_subnormals_by_value_and_tie_only_the_two_zeros():
    tiny = np.float32(1e-40)  # XLA:CPU compares subnormals as zeros (denormals-are-zero); the keys do not
    x = np.asarray([[tiny], [0.0], [-tiny], [1.0], [-0.0], [2.0]], np.float32)
    rank = np.argsort(np.argsort(x, axis=0, kind="stable"), axis=0, kind="stable")  # [[3], [1], [0], [4], [2], [5]]
    np.testing.assert_array_equal(jax.jit(column_kept_ranks)(x, np.ones(6), 2), (rank >= 2) & (rank < 4))
