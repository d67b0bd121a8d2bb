"""benchmarks/eigenbasis_refresh.py: each QR pass it times against the library's is a CholeskyQR
pass (the same Q), the library's own is among those it times, and its patch of the library's pass
is undone, also after an error."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from test_linalg import assert_is_q_of, with_condition_number

from hf_evon.optim import linalg

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
refresh = pytest.importorskip("eigenbasis_refresh")


@pytest.mark.parametrize("name", list(refresh.OTHER_PASSES))
def test_every_other_pass_gives_the_librarys_q(name: str) -> None:
    # 256 columns: linalg.gram's blocked product splits them once (halves of GRAM_MIN_BLOCK); at
    # κ = 1e6 the last columns of Q move by ~κ·ε ≈ 2e-10 under another order of rounding
    a = with_condition_number(2, 2 * linalg.GRAM_MIN_BLOCK, 1e6, seed=11)
    want, failed = linalg.cholesky_qr(a)
    with refresh.patched_pass(refresh.OTHER_PASSES[name]):
        got, failed_too = linalg.cholesky_qr(a)
    assert not failed.any() and not failed_too.any()
    for i in range(2):
        assert_is_q_of(got[i], a[i], tol=1e-9)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_the_librarys_pass_is_the_first_row_and_the_others_exclude_it() -> None:
    assert next(iter(refresh.PASSES.values())) is linalg._cholesky_qr_pass
    assert len(refresh.OTHER_PASSES) == len(refresh.PASSES) - 1


def test_the_recursive_inverse_of_a_lower_factor_is_its_inverse() -> None:
    a = with_condition_number(3, 300, 1e3, seed=12)
    low = torch.linalg.cholesky(a.mT @ a)
    inverse = refresh.lower_inverse(low)  # 300 -> 150 -> 75: two levels of blocks, then solves
    torch.testing.assert_close(inverse @ low, torch.eye(300, dtype=low.dtype).expand(3, 300, 300), rtol=0, atol=1e-9)
    assert torch.equal(inverse, inverse.tril())


def test_the_patch_is_undone_after_an_error() -> None:
    library_pass = linalg._cholesky_qr_pass
    with pytest.raises(RuntimeError, match="inside"), refresh.patched_pass(refresh.qr_pass_blocked_gram):
        assert linalg._cholesky_qr_pass is refresh.qr_pass_blocked_gram
        raise RuntimeError("inside")
    assert linalg._cholesky_qr_pass is library_pass



def test_one_call_per_bucket_ungroups_the_steps_refresh_and_is_undone_after_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step variant without grouping hands the refresh's ``power_qr_many`` ``grouped=False``
    (one QR call per stack, also off a CPU) and puts the function back, also after an error."""
    from hf_evon.optim import functional

    asked = []

    def recorder(pairs: list, grouped: bool | None = None) -> list:
        asked.append(grouped)
        return []

    monkeypatch.setattr(functional, "power_qr_many", recorder)
    with pytest.raises(RuntimeError, match="inside"):
        with refresh.one_call_per_bucket():
            functional.power_qr_many([])
            raise RuntimeError("inside")
    assert asked == [False]
    assert functional.power_qr_many is recorder


def test_the_refresh_variants_start_with_the_library_and_undo_their_settings_after_an_error() -> None:
    """``REFRESH_VARIANTS``: the library's way first (no patch), the others change what they name
    inside the block (grouping off, the batched Cholesky for every side) and undo it, also after an
    error."""
    from hf_evon.optim import functional

    names = list(refresh.REFRESH_VARIANTS)
    assert names[0] == refresh.LIBRARY
    many, side = functional.power_qr_many, linalg.CHOLESKY_ALONE_MIN_SIDE
    with refresh.REFRESH_VARIANTS[refresh.LIBRARY]():
        assert (functional.power_qr_many, linalg.CHOLESKY_ALONE_MIN_SIDE) == (many, side)
    with pytest.raises(RuntimeError, match="inside"):
        with refresh.REFRESH_VARIANTS["ungrouped, batched Cholesky"]():
            assert functional.power_qr_many is not many
            assert linalg.CHOLESKY_ALONE_MIN_SIDE > 1 << 40
            raise RuntimeError("inside")
    assert (functional.power_qr_many, linalg.CHOLESKY_ALONE_MIN_SIDE) == (many, side)
