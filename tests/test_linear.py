"""The GEMM kernels of the weight modes: what they compute and that a row's bits never depend on how
many rows share the call (what cold == warm rests on)."""

from __future__ import annotations

import pytest
import torch

from hotprefix.model import linear
from hotprefix.model.attention import MIN_Q_ROWS, min_q_rows

needs_fp16 = pytest.mark.skipif(not linear.fp16_gemm_exists(),
                                reason="this torch build has no fp16-weight GEMM (FBGEMM)")


@needs_fp16
def test_fp16_weights_multiply_fp32_inputs_in_fp32():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g) * 0.05
    x = torch.randn(7, 160, generator=g) * 3
    b = torch.randn(96, generator=g)
    y = linear._fp16_linear(x, linear.Fp16Weight(w), b)
    assert y.dtype == torch.float32
    exact = x.double() @ w.half().double().T + b.double()
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-5)  # fp32 arithmetic, fp16 weights
    # inputs rounded to bf16 (what a bf16 GEMM does) are two orders of magnitude further off
    rounded = linear._fp16_linear(x.bfloat16().float(), linear.Fp16Weight(w), b)
    assert (rounded.double() - exact).abs().max() > 50 * (y.double() - exact).abs().max()
    assert linear.weight_bytes(linear.Fp16Weight(w)) == w.numel() * 2


@needs_fp16
def test_fp16_weight_rows_do_not_depend_on_the_row_count():
    """Where the mixed mode holds fp16 weights, every row keeps its bits at any row count; where
    FBGEMM's kernels for this CPU do not (its AVX2 ones), the probe says so and ``high_linear``
    holds fp32 weights instead (checked below, with oneDNN's own row floor)."""
    if not linear.fp16_weights_available():
        assert linear.high_linear(torch.device("cpu"))[2] == "w32"
        pytest.skip("fp16-weight GEMM not row-invariant on this CPU: the mixed mode holds fp32 "
                    "weights here (asserted)")
    g = torch.Generator().manual_seed(1)
    w = linear.Fp16Weight(torch.randn(576, 1536, generator=g) * 0.05)
    x = torch.randn(300, 1536, generator=g)
    full = linear._fp16_linear(x, w, None)
    for m in (1, 2, 3, 5, 16, 17, 64, 129):
        assert torch.equal(linear._fp16_linear(x[:m], w, None), full[:m]), m
        assert torch.equal(linear._fp16_linear(x[-m:], w, None), full[-m:]), m


def test_fp16_probe_sees_a_row_dependent_kernel(monkeypatch):
    """The probe refuses a GEMM whose rows change bits with the row count (as FBGEMM's AVX2 fp16
    kernels do), and accepts one that does not."""
    real = linear._fp16_linear

    def row_dependent(x, w, b):  # one row alone takes another summation order
        y = real(x, w, b)
        return y + 1e-6 * y.abs() if x.shape[0] == 7 else y

    monkeypatch.setattr(linear, "_fp16_linear", row_dependent)
    assert not linear.fp16_rows_invariant()
    monkeypatch.setattr(linear, "_fp16_linear", lambda x, w, b: x[:, :576] * 3.0)  # row-local
    assert linear.fp16_rows_invariant()


def test_high_linear_falls_back_to_fp32_weights(monkeypatch):
    monkeypatch.setattr(linear, "fp16_weights_available", lambda: False)
    pack, lin, tag = linear.high_linear(torch.device("cpu"))
    assert tag == "w32"
    w = torch.randn(8, 16)
    x = torch.randn(3, 16)
    assert torch.allclose(lin(x, pack(w), None), x @ w.T, atol=1e-5)


def test_attention_query_rows_floor():
    assert min_q_rows(torch.bfloat16) == MIN_Q_ROWS
    assert 1 <= min_q_rows(torch.float32) <= MIN_Q_ROWS


def test_a_probe_is_remembered_per_machine(tmp_path, monkeypatch):
    """A start-up probe runs once per torch build and CPU: the next call reads its answer; a
    damaged entry runs it again; an unwritable cache directory still gives the answer."""
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path))
    calls = []

    def probe():
        calls.append(1)
        return False

    assert linear.remembered_probe("p", probe) is False
    assert linear.remembered_probe("p", probe) is False and len(calls) == 1
    (entry,) = (tmp_path / "probes").iterdir()
    entry.write_text("garbage")
    assert linear.remembered_probe("p", probe) is False and len(calls) == 2
    assert entry.read_text() == "0"
    monkeypatch.setenv("HOTPREFIX_CACHE_DIR", str(tmp_path / "file"))
    (tmp_path / "file").write_text("not a directory")
    assert linear.remembered_probe("p", lambda: True) is True
