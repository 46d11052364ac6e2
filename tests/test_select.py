"""The logits' top-k and argmax (``select.c``) at every ISA level this CPU runs: the same indices as
the portable build, as a ranking in Python and as ``torch.argmax``, on hostile rows (lengths around
the 8- and 16-lane vectors and the 32-value compare rounds, many ties, NaN at the start, in the
middle, in the last partial vector and last, infinities, all-equal rows, signed zeros, ascending
rows) and every k from 1 to 64. Levels the CPU cannot run are skipped, saying so; they are tested
on the machines that have them."""

from __future__ import annotations

import math

import pytest
import torch

from hotprefix.model import fused, isa
from isa_support import level_lib

LENGTHS = (1, 7, 8, 9, 15, 16, 17, 31, 33, 100, 4099, 49152)
NAN, INF = float("nan"), float("inf")


def _ranked(row: list[float]) -> list[int]:
    """Indices of a row, best first: a NaN above every number (NaNs by index), then larger values,
    ties (-0.0 == 0.0 included) to the lower index."""
    return sorted(range(len(row)),
                  key=lambda i: (not math.isnan(row[i]), 0.0 if math.isnan(row[i]) else -row[i], i))


def _hostile_rows(n: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Named rows of length n."""
    rows = {
        "normal": torch.randn(n, generator=g),
        "ties": torch.randint(-4, 5, (n,), generator=g).float(),
        "two values": torch.randint(0, 2, (n,), generator=g).float(),
        "all equal": torch.full((n,), 1.5),
        "all -inf": torch.full((n,), -INF),
        "all +inf": torch.full((n,), INF),
        "all nan": torch.full((n,), NAN),
        "ascending": torch.arange(n, dtype=torch.float32),
        "descending": -torch.arange(n, dtype=torch.float32),
        "max last": torch.cat([torch.rand(n - 1, generator=g), torch.tensor([2.0])]),
    }
    z = torch.randint(0, 2, (n,), generator=g).float()
    rows["signed zeros"] = torch.where(z > 0, torch.tensor(0.0), torch.tensor(-0.0))
    neg = -torch.rand(n, generator=g) - 1.0  # every value below the zeros
    neg[n // 3] = -0.0
    neg[(2 * n) // 3] = 0.0  # equal to the -0.0 before it: the lower index wins
    rows["-0 then +0 top"] = neg
    inf = torch.randn(n, generator=g)
    inf[torch.rand(n, generator=g) < 0.1] = INF
    inf[torch.rand(n, generator=g) < 0.1] = -INF
    rows["+-inf"] = inf
    for name, at in (("nan first", 0), ("nan middle", n // 2), ("nan last", n - 1),
                     ("nan in last partial vector", n - 1 - (n % 8) // 2 if n % 8 else n - 3),
                     ("nan past the prefix", min(n - 1, 9000)), ("nan at 8", min(n - 1, 8))):
        r = torch.randn(n, generator=g)
        r[max(at, 0)] = NAN
        rows[name] = r
    many = torch.randint(-4, 5, (n,), generator=g).float()
    many[torch.rand(n, generator=g) < 0.05] = NAN
    rows["scattered nan and ties"] = many
    few = torch.randn(n, generator=g)
    few[torch.randperm(n, generator=g)[:min(n, 40)]] = NAN  # k above and below the NaN count
    rows["40 nans"] = few
    late = torch.randn(n, generator=g) - 10.0
    late[-min(n, 70):] = torch.randn(min(n, 70), generator=g) + 10.0  # the top k all at the end
    rows["top at the end"] = late
    if n >= 8192:  # lanes whose last values before 8,192 (where the AVX2 path bounds the start) are NaN
        lanes = torch.full((n,), -5.0)
        lanes[8176:8184] = NAN
        lanes[8184:8192] = 7.0
        rows["nan lanes at 8192"] = lanes
    return rows


def _ks(n: int) -> list[int]:
    return list(range(1, min(n, 64) + 1))


@pytest.fixture(scope="module")
def cases():
    """(length, row name, row, its Python ranking's first 64), computed once for every level."""
    g = torch.Generator().manual_seed(23)
    out = []
    for n in LENGTHS:
        for name, row in _hostile_rows(n, g).items():
            out.append((n, name, row.contiguous(), _ranked(row.tolist())[:64]))
    return out


def _ops(level: str) -> fused.FusedOps:
    return fused.FusedOps(level_lib(level), 1e-5, 9, 3, 64)


@pytest.mark.parametrize("level", [lv.name for lv in isa.LEVELS])
def test_each_level_selects_like_python_torch_and_the_portable_build(level, cases):
    ops, ref = _ops(level), _ops("portable")
    for n, name, row, ranking in cases:
        x = row.view(1, n)
        am = ops.argmax(x)
        assert am == ref.argmax(x) == [ranking[0]] == x.argmax(dim=-1).tolist(), (n, name)
        for k in _ks(n):
            got = ops.top_k(x, k)[0].tolist()
            assert got == ranking[:k], (n, name, k)
            if level != "portable":
                assert got == ref.top_k(x, k)[0].tolist(), (n, name, k)


@pytest.mark.parametrize("level", [lv.name for lv in isa.LEVELS])
def test_each_level_selects_batched_rows_like_each_row_alone(level, cases):
    """A batch of hostile rows (threads share the rows from 4 on) gives each row's answer alone
    and the portable build's, on one thread and on two."""
    ops, ref = _ops(level), _ops("portable")
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for n in (33, 4099, 49152):
                batch = [(row, ranking) for m, _, row, ranking in cases if m == n]
                x = torch.stack([row for row, _ in batch])
                for k in (1, 32, min(n, 64)):
                    top = ops.top_k(x, k)
                    assert torch.equal(top, ref.top_k(x, k)), (t, n, k)
                    assert top.tolist() == [ranking[:k] for _, ranking in batch], (t, n, k)
                assert ops.argmax(x) == ref.argmax(x) == [r[0] for _, r in batch] \
                    == x.argmax(dim=-1).tolist(), (t, n)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("level", [lv.name for lv in isa.LEVELS])
def test_each_level_matches_the_portable_build_on_random_tie_heavy_rows(level):
    """Many random rows (values from a few levels, NaN and infinities sprinkled) of lengths
    around the vector and round widths, every k: the level's indices are the portable build's."""
    ops, ref = _ops(level), _ops("portable")
    g = torch.Generator().manual_seed(29)
    for trial in range(60):
        n = [9, 24, 31, 32, 33, 63, 65, 96, 127, 129, 300, 1023][trial % 12]
        x = torch.randint(-2, 3, (5, n), generator=g).float() * (1 + trial % 3)
        if trial % 2:
            x[torch.rand(5, n, generator=g) < 0.03] = NAN
        if trial % 3 == 0:
            x[torch.rand(5, n, generator=g) < 0.05] = INF if trial % 2 else -INF
        if trial % 4 == 1:
            x[x == 0] = -0.0
        assert ops.argmax(x) == ref.argmax(x) == x.argmax(dim=-1).tolist(), trial
        for k in _ks(n):
            assert torch.equal(ops.top_k(x, k), ref.top_k(x, k)), (trial, k)


@pytest.mark.parametrize("level", [lv.name for lv in isa.LEVELS])
def test_each_level_refuses_k_outside_its_range(level):
    ops = _ops(level)
    for n, k in ((10, 0), (10, 11), (100, 65)):
        with pytest.raises(ValueError, match="top-k"):
            ops.top_k(torch.zeros(2, n), k)
