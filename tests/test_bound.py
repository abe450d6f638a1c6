"""The compute bound dart-kernels --time prints (dart_core/kernels/bound.py): the instruction counts a
row's arithmetic needs, the rates measured on this CPU, and the lines beside each measured cost."""

import pytest
import torch

from dart_core import kernels
from dart_core.kernels import bound

AVX2 = bound.IssueRates(clock_hz=3e9, lanes=8, dot=2.0, madd=2.0, fma=2.0, mix=2.25, vnni=False)
VNNI = bound.IssueRates(clock_hz=3e9, lanes=16, dot=1.0, madd=1.0, fma=2.0, mix=2.0, vnni=True)


def _blocks(fmt: str, N: int, K: int, activations: str) -> kernels.BlockWeight:
    per = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[fmt]
    return kernels.BlockWeight(fmt, N, K, torch.zeros(N, K // 32 * per, dtype=torch.uint8)).with_activations(activations)


@pytest.mark.parametrize(
    "fmt,act,rates,dot,fma",
    [
        # per (lanes weight rows x a block of 32): the dot products (and their widening), the scaling
        ("Q4_1", "int8", AVX2, 9, 4),
        ("Q4_1", "int16", AVX2, 16, 4),  # AVX2's many-row kernel: vpmaddwd on the 16-bit codes
        ("Q4_0", "int16", AVX2, 16, 4),
        ("Q8_0", "int8", AVX2, 16, 3),
        ("Q8_0", "int16", AVX2, 16, 3),
        ("Q4_1", "int8", VNNI, 8, 4),
        ("Q4_1", "int16", VNNI, 16, 4),
        ("Q8_0", "int16", VNNI, 16, 3),
    ],
)
def test_a_linear_row_counts_its_dot_products_and_scaling(fmt, act, rates, dot, fma):
    N, K = 64, 576
    units = N / rates.lanes * K / 32
    assert bound.linear_work(_blocks(fmt, N, K, act), rates) == bound.Work(dot=units * dot, fma=units * fma)


def test_vpmaddwd_counts_at_its_own_rate():
    # AVX2's 16-bit kernel issues vpmaddwd: its count is taken in the time of the dot-product rate
    rates = bound.IssueRates(clock_hz=3e9, lanes=8, dot=1.5, madd=2.0, fma=2.0, mix=2.25, vnni=False)
    w = bound.linear_work(_blocks("Q4_1", 64, 576, "int16"), rates)
    units = 64 / 8 * 576 / 32
    assert w.dot / rates.dot == pytest.approx(units * 16 / rates.madd)


def test_avx2_takes_each_product_with_its_accumulating_add():
    # AVX2 has no accumulating integer product: the sums' adds share the ports, at the pairs' rate
    rates = bound.IssueRates(clock_hz=3e9, lanes=8, dot=2.0, madd=2.0, fma=2.0, mix=2.25, vnni=False, madd_add=1.5, maddubs_add=1.6)
    units = 64 / 8 * 576 / 32
    w16 = bound.linear_work(_blocks("Q4_1", 64, 576, "int16"), rates)
    assert w16.dot / rates.dot == pytest.approx(units * 16 / 1.5)  # 16 vpmaddwd + vpaddd
    w8 = bound.linear_work(_blocks("Q4_0", 64, 576, "int8"), rates)
    assert w8.dot / rates.dot == pytest.approx(units * (7 / 1.6 + 1 / 2.0 + 1 / 2.0))  # 7 pairs, 1 alone, the widening
    head = bound.linear_work(_blocks("Q8_0", 64, 576, "int8"), rates)
    assert head.dot / rates.dot == pytest.approx(units * (8 / 2.0 + 8 / 1.5))
    assert "vpmaddwd + vpaddd 1.50" in rates.describe()
    # VNNI's vpdpbusd accumulates: its count is unchanged by pair rates
    vnni = bound.IssueRates(clock_hz=3e9, lanes=16, dot=1.0, madd=1.0, fma=2.0, mix=2.0, vnni=True, madd_add=0.5, maddubs_add=0.5)
    assert bound.linear_work(_blocks("Q4_1", 64, 576, "int8"), vnni) == bound.linear_work(_blocks("Q4_1", 64, 576, "int8"), VNNI)


def test_float_weights_and_attention_count_fmas():
    assert bound.linear_work(torch.zeros(48, 64), AVX2) == bound.Work(fma=48 * 64 / 8)
    assert bound.linear_work(_blocks("Q4_1", 16, 64, "float"), AVX2) == bound.Work(fma=16 * 64 / 8)
    assert bound.attention_work(9, 64, 100, VNNI) == bound.Work(fma=2 * 9 * 64 * 100 / 16)


def test_cycles_take_the_tightest_of_the_ports():
    assert bound.Work(dot=100).cycles(AVX2) == 50  # dot products alone
    assert bound.Work(fma=100).cycles(AVX2) == 50
    assert bound.Work(dot=100, fma=100).cycles(AVX2) == pytest.approx(200 / 2.25)  # shared ports: the mixed rate
    assert bound.Work(dot=90, fma=10).cycles(VNNI) == 90  # VNNI's one dot product a cycle
    assert bound.ms(bound.Work(dot=6e6), AVX2, threads=2) == pytest.approx(0.5)
    assert (bound.Work(1, 2) + bound.Work(3, 4)) * 2 == bound.Work(8, 12)


@pytest.mark.skipif(not kernels.AVAILABLE or kernels.PATH == "generic", reason="no vector kernels on this CPU")
def test_issue_rates_are_measured_on_this_cpu():
    r = bound.issue_rates()
    assert 0.5e9 < r.clock_hz < 7e9
    assert r.lanes == (16 if kernels.PATH.startswith("avx512") else 8)
    assert r.vnni == (kernels.PATH == "avx512bf16")
    for rate in (r.dot, r.madd, r.fma, r.mix, r.madd_add, r.maddubs_add):
        assert 0.2 < rate < 8, r  # instructions per cycle on one core: every x86 core issues 1-4 of these
    assert "GHz" in r.describe() and ("vpdpbusd" if r.vnni else "vpmaddubsw") in r.describe()


@pytest.mark.skipif(not kernels.AVAILABLE or kernels.PATH == "generic", reason="no vector kernels on this CPU")
def test_kernels_time_prints_each_cost_beside_its_bound(tiny_llama):
    from dart_core.cli.kernels import bound_lines, row_work

    model, r = tiny_llama.model, bound.issue_rates()
    ms = {1: 0.5, 4: 1.1}
    header, cells = bound_lines("float32", model, ms, prefix=10, rates=r, bandwidth=10.0)
    one = bound.ms(row_work(model, 11, r), r, torch.get_num_threads())
    memory = model.step_weight_bytes() / 10.0 / 1e6
    assert f"a row's arithmetic {one:.2f} ms" in header and f"at 10.0 GB/s: {memory:.2f} ms" in header
    four = max(sum(bound.ms(row_work(model, 10 + i + 1, r), r, torch.get_num_threads()) for i in range(4)), memory)
    assert f"1 rows 0.50 / {max(one, memory):.2f} ms" in cells
    assert f"4 rows 1.10 / {four:.2f} ms ({1.1 / four:.2f}x), an extra row 0.20 ms ({0.2 / one:.2f}x a row's bound)" in cells
    assert row_work(model, 11, r).fma > row_work(model, 11, r, head=False).fma


@pytest.mark.skipif(not kernels.AVAILABLE or kernels.PATH == "generic", reason="no vector kernels on this CPU")
def test_kernels_prefill_prints_a_prompt_token_beside_its_bound(tiny_llama):
    from dart_core.cli.kernels import prefill_bound_ms, prefill_line, row_work

    model, r = tiny_llama.model, bound.issue_rates()
    threads = torch.get_num_threads()
    b = prefill_bound_ms(model, 12, r)
    # row i over its i + 1 keys without the LM head, and the head once for the last row's logits
    rows = sum(bound.ms(row_work(model, i + 1, r, head=False), r, threads) for i in range(12))
    assert b == pytest.approx(rows + bound.ms(bound.linear_work(model.output.weight, r), r, threads))
    assert prefill_bound_ms(model, 13, r) > b
    line = prefill_line("float32", tiny_llama, 12, r)
    assert line.startswith("float32   prefill of 12 tokens: ") and f"its arithmetic {b / 12:.3f} ms a token (" in line
    ms_token = float(line.split(", ")[1].split(" ms a token")[0])
    assert ms_token > 0


def test_kernels_prefill_needs_time_and_a_length():
    from dart_core.cli.kernels import main

    with pytest.raises(SystemExit):
        main(["--prefill", "16"])
    with pytest.raises(SystemExit):
        main(["--time", "float32", "--prefill", "0"])
