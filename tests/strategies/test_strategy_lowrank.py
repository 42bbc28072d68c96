"""PowerSGD's per-bucket linear algebra (:mod:`distopt.strategies.lowrank`) against NumPy's own.

The padded stack's Gram-Schmidt against a Householder QR of each factor
(``numpy.linalg.qr``, the signs made those of Gram-Schmidt: a positive
diagonal of ``R``), for factors of different shapes and ranks in one
buffer; a zero factor stays zero; the column-by-column products against
``@``.
"""
from __future__ import annotations

import numpy as np
import pytest

from distopt.strategies.lowrank import Stack, project

pytestmark = pytest.mark.unit


def _qr_reference(m: np.ndarray) -> np.ndarray:
    q, r = np.linalg.qr(m)
    return q * np.sign(np.diag(r))


def test_stack_orthonormalizes_every_factor_as_a_qr_would():
    shapes = [(7, 2), (30, 3), (5, 1), (12, 4), (3, 3)]  # rows and ranks differ: padding in both
    rng = np.random.default_rng(0)
    factors = [rng.standard_normal(s) for s in shapes]
    flat = np.concatenate([f.reshape(-1) for f in factors])
    stack = Stack(shapes, np)
    assert stack.size == flat.size and stack.pad_shape == (5, 4, 30)
    assert stack.orthonormalize(flat) is flat
    for got, f in zip(stack.views(flat), factors):
        np.testing.assert_allclose(got, _qr_reference(f), rtol=0, atol=1e-12)


def test_stack_keeps_a_zero_factor_zero_and_float32_orthonormal():
    shapes = [(40, 2), (9, 2)]
    rng = np.random.default_rng(1)
    flat = np.concatenate([rng.standard_normal(80), np.zeros(18)]).astype(np.float32)
    first, zero = Stack(shapes, np).views(Stack(shapes, np).orthonormalize(flat))
    np.testing.assert_allclose(first.astype(np.float64).T @ first, np.eye(2), rtol=0, atol=1e-6)
    assert not zero.any() and np.isfinite(flat).all()


@pytest.mark.parametrize("transposed", [False, True])
def test_project_is_the_matrix_product(transposed):
    rng = np.random.default_rng(2)
    m = rng.standard_normal((13, 21)).astype(np.float32)
    a = m.T if transposed else m
    v = rng.standard_normal((a.shape[1], 3)).astype(np.float32)
    out = np.full((a.shape[0], 3), np.nan, dtype=np.float32)
    assert project(a, v, out) is out
    np.testing.assert_allclose(out, a.astype(np.float64) @ v, rtol=1e-5, atol=1e-5)
