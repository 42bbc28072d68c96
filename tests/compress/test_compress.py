"""Tests of distopt.compress: top-k, threshold, densify and half-precision casts.

NumPy results are checked against brute-force references (a stable
``np.argsort``); CuPy results (tests marked ``gpu``) against the NumPy ones.
"""
from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest

import distopt.compress.threshold as threshold
import distopt.compress.topk as topk
from distopt.compress import densify, from_wire, half_scales, k_for, threshold_indices, to_wire, topk_indices
from distopt.compress._xp import index_dtype

pytestmark = pytest.mark.unit

FLOATS = [np.float16, np.float32, np.float64]


def reference_topk(x: np.ndarray, k: int) -> np.ndarray:
    """Ascending positions of the k largest |x|, lowest first among ties, NaN below every number."""
    mag = np.abs(x.astype(np.float64))
    mag[np.isnan(mag)] = -1
    return np.sort(np.argsort(-mag, kind="stable")[:k])


@pytest.fixture(params=["exact", "sampled"])
def path(request, monkeypatch):
    """Run a top-k test on the exact path and on the sampled one (tiny sample, tiny blocks, 3 ranges)."""
    if request.param == "sampled":
        monkeypatch.setattr(topk, "_SAMPLE_SIZE", 64)
        monkeypatch.setattr(threshold, "_CHUNK", 100)
        monkeypatch.setattr(threshold, "_MIN_RANGE", 300)
        monkeypatch.setattr(threshold, "_cpus", lambda: 3)
    return request.param


def check_topk(x: np.ndarray, k: int) -> np.ndarray:
    got = topk_indices(x, k)
    assert got.dtype == np.int32
    assert got.shape == (k,)
    np.testing.assert_array_equal(got, reference_topk(x, k))
    return got


# --- k_for -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "ratio", "k"),
    [(3, 0.1, 1), (4, 1.0, 4), (1000, 0.01, 10), (100, 0.07, 7), (1001, 0.01, 11), (0, 0.5, 0), (5, 1e-9, 1)],
)
def test_k_for(n, ratio, k):
    assert k_for(n, ratio) == k


@pytest.mark.parametrize("ratio", [1.5, 0, 0.0, -0.1, float("nan")])
def test_k_for_rejects_ratio(ratio):
    with pytest.raises(ValueError, match="spars"):
        k_for(100, ratio)


def test_k_for_rejects_negative_n():
    with pytest.raises(ValueError):
        k_for(-1, 0.5)


# --- topk_indices ------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 2, 7, 130, 1000, 4099])
def test_topk_matches_argsort(path, dtype, n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(dtype)
    for k in sorted({1, max(1, n // 100), max(1, n // 7), n // 2, n}):
        check_topk(x, k)


def test_h14_ties_exactly_k():
    got = check_topk(np.array([1, 1, 1, 1, 0.5], dtype=np.float32), 2)
    np.testing.assert_array_equal(got, [0, 1])


@pytest.mark.parametrize("dtype", FLOATS)
def test_h14_many_ties_never_more_than_k(path, dtype):
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, 5000).astype(dtype)  # 7 distinct values, ties everywhere
    for k in (1, 13, 700, 2500, 4999):
        check_topk(x, k)


def test_topk_k_edges():
    x = np.array([3.0, -1.0, 2.0])
    check_topk(x, 1)
    check_topk(x, 3)
    empty = topk_indices(x, 0)
    assert empty.shape == (0,) and empty.dtype == np.int32
    none = topk_indices(np.empty(0, dtype=np.float32), 0)
    assert none.shape == (0,) and none.dtype == np.int32


def test_topk_negative_values_by_magnitude():
    np.testing.assert_array_equal(topk_indices(np.array([-5.0, 1.0, -3.0, 4.0]), 2), [0, 3])


def test_topk_nan_ranks_last_inf_first():
    x = np.array([np.nan, 1.0, np.nan, 2.0, -np.inf])
    np.testing.assert_array_equal(topk_indices(x, 1), [4])
    np.testing.assert_array_equal(topk_indices(x, 4), [0, 1, 3, 4])


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda n, rng: np.full(n, 0.5, dtype=np.float32), id="all-equal"),
        pytest.param(lambda n, rng: np.where(np.arange(n) == 4321, 1e30, rng.standard_normal(n)), id="huge-outlier"),
        pytest.param(lambda n, rng: np.where(rng.random(n) < 0.99, 0, rng.standard_normal(n)), id="many-zeros"),
        pytest.param(lambda n, rng: np.zeros(n, dtype=np.float16), id="all-zero"),
        pytest.param(lambda n, rng: rng.standard_cauchy(n), id="heavy-tail"),
        pytest.param(lambda n, rng: np.sort(rng.standard_normal(n)), id="sorted"),
        pytest.param(lambda n, rng: np.where(rng.random(n) < 0.5, np.nan, rng.standard_normal(n)), id="half-nan"),
    ],
)
def test_topk_adversarial_sampling(path, make):
    n = 20_000
    x = np.asarray(make(n, np.random.default_rng(7)))
    for k in (1, 10, 200, 1000, 9000, n):
        check_topk(x, k)


def test_topk_sample_larger_than_array():
    x = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    check_topk(x, 5)  # default sample (100000) > n: exact path


def test_topk_fallback_when_sample_overestimates(monkeypatch):
    """The sampled positions hold the only large values: fewer than k candidates pass."""
    monkeypatch.setattr(topk, "_SAMPLE_SIZE", 1000)
    n, k = 100_000, 2000
    x = np.ones(n, dtype=np.float32)
    x[np.random.default_rng(topk._SEED).integers(0, n, 1000)] = 2.0
    assert np.count_nonzero(x == 2) < k
    check_topk(x, k)


def test_topk_default_sample_size_large_array():
    x = np.random.default_rng(1).standard_normal(300_000).astype(np.float32)
    for k in (1, 300, 3000):
        check_topk(x, k)


def test_topk_errors():
    x = np.ones(4)
    with pytest.raises(ValueError):
        topk_indices(x, 5)
    with pytest.raises(ValueError):
        topk_indices(x, -1)
    with pytest.raises(ValueError):
        topk_indices(np.ones((2, 2)), 1)
    with pytest.raises(TypeError):
        topk_indices(x, 1.5)


def test_index_dtype():
    assert index_dtype(0) == np.int32
    assert index_dtype(2**31 - 1) == np.int32
    assert index_dtype(2**31) == np.int64


# --- threshold_indices -------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_threshold_matches_reference(path, dtype):
    x = np.random.default_rng(2).standard_normal(3000).astype(dtype)
    for thr in (0.0, 0.5, 1.7, 3.0):
        got = threshold_indices(x, thr)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.flatnonzero(np.abs(x.astype(np.float64)) >= thr))


def test_h12_threshold_selects_nothing():
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    for arr, thr in [(x, 100.0), (np.zeros(10, dtype=np.float32), 1e-3), (np.empty(0, dtype=np.float32), 0.0)]:
        got = threshold_indices(arr, thr)
        assert got.shape == (0,) and got.dtype == np.int32


def test_threshold_is_exact_not_rounded_to_dtype():
    # 1e-8 rounds to 0 in float16; zeros must still not pass.
    assert threshold_indices(np.zeros(5, dtype=np.float16), 1e-8).size == 0
    below = np.nextafter(np.float32(0.1), np.float32(0))  # < 0.1 as a real number
    at = np.float32(0.1)  # 0.100000001... >= 0.1
    np.testing.assert_array_equal(threshold_indices(np.array([below, at, -at]), 0.1), [1, 2])


def test_threshold_huge_and_zero():
    x = np.array([np.inf, 1.0, 0.0, np.nan, -0.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_array_equal(threshold_indices(x, 1e300), [0])
    np.testing.assert_array_equal(threshold_indices(x, 0.0), [0, 1, 2, 4])


@pytest.mark.parametrize("thr", [-1e-9, float("nan")])
def test_threshold_rejects_bad_threshold(thr):
    with pytest.raises(ValueError):
        threshold_indices(np.ones(3), thr)


# --- densify -----------------------------------------------------------------


def test_densify_duplicates_add():
    out = densify(np.array([0, 2, 2, 5], dtype=np.int32), np.array([1, 2, 3, 4], dtype=np.float32), 6)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [1, 0, 5, 0, 0, 4])


def test_densify_lists_from_ranks():
    idx = [np.array([1, 3], dtype=np.int32), np.array([3, 0], dtype=np.int32)]
    val = [np.array([1.0, 2.0]), np.array([0.5, -1.0])]
    np.testing.assert_array_equal(densify(idx, val, 4, np.float32), [-1, 1, 0, 2.5])


def test_densify_random_matches_loop():
    rng = np.random.default_rng(4)
    idx = rng.integers(0, 50, 1000)
    val = rng.standard_normal(1000)
    expected = np.zeros(50)
    for i, v in zip(idx, val):
        expected[i] += v
    np.testing.assert_array_equal(densify(idx, val, 50), expected)


def test_densify_precision():
    # float64 sums in index order, as a plain loop: 0.1 + 0.2 (not 0.3)
    assert densify(np.array([0, 0]), np.array([0.1, 0.2]), 1)[0] == 0.1 + 0.2
    # float32 input accumulates in float32, in the order given, like a dense float32 all-reduce
    vals = np.array([1e8, 1, -1e8], dtype=np.float32)
    assert densify(np.zeros(3, dtype=np.int64), vals, 1)[0] == (np.float32(1e8) + np.float32(1)) - np.float32(1e8)
    # ... and in float64 when a float64 result is asked for
    assert densify(np.zeros(3, dtype=np.int64), vals, 1, np.float64)[0] == 1
    f16 = densify(np.array([0, 0]), np.array([1, 2], dtype=np.float16), 2)
    assert f16.dtype == np.float16 and f16.tolist() == [3, 0]


def test_densify_empty():
    out = densify(np.empty(0, dtype=np.int32), np.empty(0, dtype=np.float32), 3)
    assert out.dtype == np.float32 and out.tolist() == [0, 0, 0]
    assert densify([], [], 2, np.float32).tolist() == [0, 0]


@pytest.mark.parametrize(
    ("idx", "val", "n"),
    [
        (np.array([0, 3]), np.ones(2), 3),  # index == n
        (np.array([-1]), np.ones(1), 3),  # negative
        (np.array([0, 1]), np.ones(3), 3),  # length mismatch
        (np.array([0.0]), np.ones(1), 3),  # float indices
        (np.array([0]), np.ones(1), -1),  # negative n
    ],
)
def test_densify_errors(idx, val, n):
    with pytest.raises(ValueError):
        densify(idx, val, n)


# --- casts and scales ----------------------------------------------------------


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
def test_cast_round_trip(wire):
    x = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    w = to_wire(x, wire, 0.5)
    assert w.dtype.name == wire and w.itemsize == 2
    back = from_wire(w, np.float32, 2.0)
    assert back.dtype == np.float32
    rtol = 2.0**-11 if wire == "float16" else 2.0**-8
    np.testing.assert_allclose(back, x, rtol=rtol, atol=2.0**-24)  # float16 subnormals: absolute error
    exact = np.array([0.0, -1.0, 0.5, 1024.0], dtype=np.float32)  # representable in both
    np.testing.assert_array_equal(from_wire(to_wire(exact, wire), np.float32), exact)


def test_cast_errors(monkeypatch):
    with pytest.raises(ValueError, match="wire_dtype"):
        to_wire(np.ones(2, dtype=np.float32), "float8", 1.0)
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    with pytest.raises(ImportError, match="ml_dtypes"):
        to_wire(np.ones(2, dtype=np.float32), "bfloat16", 1.0)


def test_h06_predivide_default_avoids_fp16_overflow():
    world = 4
    pre, post = half_scales(world)
    assert (pre, post) == (0.25, 1.0)
    grads = [np.full(3, 40000, dtype=np.float32) for _ in range(world)]
    wire_sum = np.sum([to_wire(g, "float16", pre) for g in grads], axis=0, dtype=np.float16)
    assert np.all(np.isfinite(wire_sum))
    np.testing.assert_array_equal(from_wire(wire_sum, np.float32, post), 40000)
    # predivide=1 sums the raw values: 4 x 40000 > 65504 overflows, as documented.
    pre1, _ = half_scales(world, predivide=1)
    with np.errstate(over="ignore"):
        overflow = np.sum([to_wire(g, "float16", pre1) for g in grads], axis=0, dtype=np.float16)
    assert np.all(np.isinf(overflow))


def test_h07_predivide_one_keeps_small_gradients():
    world, value = 8, 1.2e-7
    grads = [np.full(3, value, dtype=np.float32) for _ in range(world)]

    def average(predivide):
        pre, post = half_scales(world, predivide)
        total = np.sum([to_wire(g, "float16", pre).astype(np.float32) for g in grads], axis=0)
        return from_wire(total, np.float32, post)

    kept = average(1)
    assert np.all(kept > 0) and np.all(np.abs(kept - value) <= 6e-8)
    assert np.all(average(None) == 0)  # 1.2e-7 / 8 underflows in float16


def test_half_scales():
    for world in (1, 3, 8, 1024):
        for predivide in (None, 1, 2.5, world):
            pre, post = half_scales(world, predivide)
            assert pre * post == pytest.approx(1 / world)
    for bad in (0, -2.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            half_scales(4, bad)
    with pytest.raises(ValueError):
        half_scales(0)


# --- CuPy (GPU) --------------------------------------------------------------


@pytest.fixture
def cp():
    """CuPy with one device: the real one where installed (skips without a device), else the stand-in."""
    from tests.support.gpu import devices

    with devices(1) as cupy:
        yield cupy


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_gpu_topk_matches_numpy(cp, dtype):
    rng = np.random.default_rng(6)
    for x in (
        rng.standard_normal(10_001).astype(dtype),
        rng.integers(-3, 4, 5000).astype(dtype),
        np.array([1, 1, 1, 1, 0.5, np.nan], dtype=dtype),
    ):
        for k in sorted({1, 2, x.size // 10, x.size // 2, x.size}):
            got = topk_indices(cp.asarray(x), k)
            assert isinstance(got, cp.ndarray) and got.dtype == np.int32
            np.testing.assert_array_equal(cp.asnumpy(got), topk_indices(x, k))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gpu_topk_sampled_path_matches_numpy(cp, dtype):
    """n above the sampling size: the device takes the sampled-threshold route, same exact result."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal(1_000_003).astype(dtype)
    x[::1000] = 0
    x[5] = np.nan
    for k in (1, 100, 10_000):
        got = topk_indices(cp.asarray(x), k)
        np.testing.assert_array_equal(cp.asnumpy(got), topk_indices(x, k))


@pytest.mark.gpu
def test_gpu_topk_sampled_path_with_too_few_candidates_takes_the_exact_route(cp):
    """Mostly NaN: the sample's threshold lets fewer than k numbers through, so the device selects exactly
    among all of x (NaN last), as NumPy does."""
    x = np.full(50_001, np.nan, dtype=np.float32)
    x[::500] = np.arange(101, dtype=np.float32)
    got = topk_indices(cp.asarray(x), 1000)
    np.testing.assert_array_equal(cp.asnumpy(got), topk_indices(x, 1000))


@pytest.mark.gpu
def test_f12_topk_syncs_the_host_at_most_once(cp):
    """F12: top-k on the device keeps the threshold, the tie count and the sample positions there: no
    host synchronisation on the exact route, one (the candidates' count) on the sampled route; densify
    none."""
    from tests.support.gpu import is_standin

    if not is_standin(cp):
        pytest.skip("counts the stand-in's host synchronisations")
    rng = np.random.default_rng(11)
    small, large = (cp.asarray(rng.standard_normal(n).astype(np.float32)) for n in (5000, 100_000))
    counters = cp._state.counters
    for x, k, most in ((small, 50, 0), (large, 100, 1), (large, 100, 1)):
        before = counters.host_syncs
        topk_indices(x, k)
        assert counters.host_syncs - before <= most, counters.sync_sites[-3:]
    idx = cp.asarray(np.array([[1, 5], [5, 7]], np.int32))
    before = counters.host_syncs
    densify(idx, cp.ones((2, 2), dtype=cp.float32), 10)
    assert counters.host_syncs == before


@pytest.mark.gpu
def test_gpu_threshold_matches_numpy(cp):
    x = np.random.default_rng(8).standard_normal(10_000).astype(np.float32)
    for thr in (0.0, 1.0, 100.0):
        got = threshold_indices(cp.asarray(x), thr)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(cp.asnumpy(got), threshold_indices(x, thr))


@pytest.mark.gpu
def test_gpu_densify_matches_numpy(cp):
    """A single array with repeated positions: the device adds them in the order given, as NumPy does."""
    rng = np.random.default_rng(9)
    idx = rng.integers(0, 100, 1000).astype(np.int32)
    val = (rng.standard_normal(1000) * 10.0 ** rng.integers(-4, 5, 1000)).astype(np.float32)
    got = densify(cp.asarray(idx), cp.asarray(val), 100)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(cp.asnumpy(got), densify(idx, val, 100))


@pytest.mark.gpu
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_f5_densify_of_gathered_pairs_is_deterministic_and_equals_numpy(cp, ranks):
    """F5: the pairs gathered from every rank (each rank's positions distinct, many shared across ranks,
    values of mixed magnitude) sum to the NumPy twin's bits on every call: replicas cannot drift apart
    (an atomic scatter-add, whose order is unspecified, would)."""
    rng = np.random.default_rng(ranks)
    idx = np.stack([np.sort(rng.choice(64, 40, replace=False)) for _ in range(ranks)]).astype(np.int32)
    val = (rng.standard_normal((ranks, 40)) * 10.0 ** rng.integers(-6, 7, (ranks, 40))).astype(np.float32)
    expect = densify(idx, val, 64)
    for _ in range(20):
        np.testing.assert_array_equal(cp.asnumpy(densify(cp.asarray(idx), cp.asarray(val), 64)), expect)
        parts = densify([cp.asarray(i) for i in idx], [cp.asarray(v) for v in val], 64)
        np.testing.assert_array_equal(cp.asnumpy(parts), expect)


@pytest.mark.gpu
def test_gpu_cast(cp):
    x = np.random.default_rng(10).standard_normal(1000).astype(np.float32)
    w = to_wire(cp.asarray(x), "float16", 0.25)
    assert w.dtype == np.float16
    np.testing.assert_array_equal(cp.asnumpy(w), to_wire(x, "float16", 0.25))
    np.testing.assert_array_equal(cp.asnumpy(from_wire(w, np.float32, 4.0)), from_wire(to_wire(x, "float16", 0.25), np.float32, 4.0))


@pytest.mark.gpu
def test_f7_bfloat16_wire_on_cupy_14(cp, monkeypatch):
    """F7: CuPy 14 holds ml_dtypes' bfloat16, so the bfloat16 wire works on the device (the NumPy twin's
    bits); CuPy 13 gets a clear error naming the version."""
    pytest.importorskip("ml_dtypes")
    x = np.random.default_rng(12).standard_normal(1000).astype(np.float32)
    if int(cp.__version__.split(".")[0]) >= 14:
        w = to_wire(cp.asarray(x), "bfloat16", 0.5)
        assert w.dtype.name == "bfloat16"
        np.testing.assert_array_equal(cp.asnumpy(w).view(np.uint16), to_wire(x, "bfloat16", 0.5).view(np.uint16))
        np.testing.assert_array_equal(cp.asnumpy(from_wire(w, np.float32, 2.0)),
                                      from_wire(to_wire(x, "bfloat16", 0.5), np.float32, 2.0))
    monkeypatch.setattr(cp, "__version__", "13.6.0")
    with pytest.raises(TypeError, match="CuPy 14 or later.*13.6.0"):
        to_wire(cp.asarray(x), "bfloat16", 1.0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_densify_into_out_equals_a_new_array(dtype):
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 50, 40)  # duplicates add
    val = rng.standard_normal(40).astype(dtype)
    out = np.full(50, 7, dtype=dtype)  # stale contents are overwritten
    got = densify(idx, val, 50, dtype, out=out)
    assert got is out
    np.testing.assert_array_equal(out, densify(idx, val, 50, dtype))
    with pytest.raises(ValueError, match="out must be 1-D of 50 elements"):
        densify(idx, val, 50, dtype, out=np.zeros(49, dtype=dtype))


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3])
def test_fast_casts_are_bitwise_numpy_casts(monkeypatch, wire, scale):
    """PyTorch's cast kernels (used for NumPy float32 arrays when PyTorch is installed) == NumPy's casts."""
    pytest.importorskip("torch")
    from distopt.core import _fastcast

    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(70_000).astype(np.float32) * s for s in (1e-7, 1.0, 3e4)]
                       + [np.array([np.inf, -np.inf, -0.0, 65520, 3e-8, 1e-45], np.float32)])
    results = []
    for fast in (True, False):
        monkeypatch.setattr(_fastcast, "HAVE_TORCH", fast)
        w = to_wire(x, wire, scale)
        results.append((w.view(np.uint16).copy(), from_wire(w, np.float32, 1 / scale)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
@pytest.mark.parametrize("n_rows", [1, 2, 3, 4])
def test_fast_sum_of_16_bit_rows_is_the_float32_sum_rounded_once(monkeypatch, wire, n_rows):
    """The MPI backend's 16-bit sum (PyTorch kernels) == NumPy: rows added in float32, rounded once."""
    pytest.importorskip("torch")
    from distopt.core import _fastcast

    dtype = np.dtype(np.float16) if wire == "float16" else np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    rng = np.random.default_rng(7)
    rows = np.stack([np.concatenate([rng.standard_normal(70_000).astype(np.float32) * s for s in (1e-6, 1.0, 2e4)]
                                    + [np.array([np.inf, -0.0, 65504, 6e-8], np.float32)]).astype(dtype)
                     for _ in range(n_rows)])
    results = []
    for fast in (True, False):
        monkeypatch.setattr(_fastcast, "HAVE_TORCH", fast)
        results.append(_fastcast.sum_rows(rows, np.empty(rows.shape[1], dtype)).view(np.uint16).copy())
    np.testing.assert_array_equal(results[0], results[1])
    if n_rows == 2:  # one rounding: a float16 pair summed exactly in float32
        want = (rows[0].astype(np.float32) + rows[1].astype(np.float32)).astype(dtype)
        np.testing.assert_array_equal(results[0], want.view(np.uint16))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_from_wire_into_a_given_array_equals_a_new_one(dtype):
    """The half strategy casts the wire sum straight into the gradient bucket (no new array, no copy)."""
    w = to_wire(np.random.default_rng(3).standard_normal(70_001).astype(np.float32), "float16", 0.5)
    out = np.full(w.size, np.nan, dtype=dtype)
    got = from_wire(w, dtype, 2.0, out=out)
    assert got is out
    np.testing.assert_array_equal(out, from_wire(w, dtype, 2.0))
