"""The compute bound of a forward on this CPU: the arithmetic instructions one row of the target's
forward issues in the kernels (the integer dot products and the per-block scaling of the GGUF paths'
linears, the fp32 fmas of the float paths and of attention), at the issue rates the extension measures
on this core (`issue_rates`: the clock, and the dot product, fma and the two mixed, per cycle), on the
threads in use. `dart-kernels --time` prints it beside each measured cost; docs/engine.md explains the
count.

Per block of 32 elements, one input row and `lanes` weight rows (8 in an AVX2 register, 16 in AVX-512;
the interleaved layout puts one weight row in each 32-bit lane):
- int8 activations on Q4_0 / Q4_1: 8 dot products (AVX2 and AVX-512 without VNNI: `vpmaddubsw`, plus
  the `vpmaddwd` that widens their 16-bit sums, 1 a block on AVX2 and 4 on AVX-512; VNNI: 8
  `vpdpbusd`), and the scaling: a conversion, the scale product and two fmas (the minimum's term);
- 16-bit activations: the dot products twice (two digits); on AVX2 the many-row kernel instead meets
  the 16-bit codes themselves in 16 `vpmaddwd` (linear_x16.cpp, Q4 and Q8_0 alike), which is what is
  counted there;
- Q8_0 (the LM head) with int8 activations: AVX2 and AVX-512 without VNNI 8 `vpmaddubsw` and 8
  `vpmaddwd` (signed codes: no 16-bit accumulation), VNNI 8 `vpdpbusd`; the scaling without the
  minimum's fma.
On AVX2 the integer products have no accumulating form (VNNI's `vpdpbusd` adds into its sums; AVX2
has no `vpdpwssd`): the sums a block needs are added up by integer adds on the same vector ports, so
there the count takes each product with the add that accumulates it, at the pair's measured rate
(`madd_add`, `maddubs_add`): the 16-bit kernel's 16 `vpmaddwd` each with a `vpaddd`; with int8
activations 7 of the 8 `vpmaddubsw` with a `vpaddw` (the 8 sums' tree) and, on Q8_0, the 8
`vpmaddwd` each with the `vpaddd` of its block sum. (AVX-512 without VNNI keeps the products alone:
not measured on such a CPU.)
Float weights or fp32 activations (`gguf`, `bfloat16`, `float32`): one fma per `lanes` products.
Attention: the scores and the weighted values, one fma per `lanes` products over the row's keys.

A row's cycles on one core are max(dot / r_dot, fma / r_fma, (dot + fma) / r_mix): on several cores
both kinds share execution ports, which the mixed rate measures. What the count leaves out (the
activations' broadcasts and quantization, the widening of Q4 codes, loads, norms, softmax) is what
a kernel may spend above the bound.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from . import builds
from .formats import BlockWeight


@dataclass(frozen=True)
class IssueRates:
    """Measured on one core of this CPU by the build in use (probe.cpp): instructions per cycle."""

    clock_hz: float
    lanes: int  # fp32 lanes of the build's vector (8: AVX2, 16: AVX-512)
    dot: float  # the integer dot product the kernels use: vpdpbusd with VNNI, else vpmaddubsw
    madd: float  # vpmaddwd
    fma: float
    mix: float  # the dot product and fma interleaved 1:1
    vnni: bool
    # each product with the integer add that accumulates its sums, in pairs per cycle (0: not measured,
    # the product's own rate is used)
    madd_add: float = 0.0  # vpmaddwd + vpaddd
    maddubs_add: float = 0.0  # vpmaddubsw + vpaddw

    @property
    def madd_pair(self) -> float:
        return self.madd_add or self.madd

    @property
    def maddubs_pair(self) -> float:
        return self.maddubs_add or self.dot

    def describe(self) -> str:
        dot = "vpdpbusd" if self.vnni else "vpmaddubsw"
        pairs = ""
        if self.lanes == 8 and self.madd_add and self.maddubs_add:
            pairs = f", vpmaddwd + vpaddd {self.madd_add:.2f}, vpmaddubsw + vpaddw {self.maddubs_add:.2f}"
        return (
            f"clock {self.clock_hz / 1e9:.2f} GHz; per cycle and core, {self.lanes * 32}-bit: {dot} {self.dot:.2f}, "
            f"vpmaddwd {self.madd:.2f}, fma {self.fma:.2f}{pairs}, {dot} + fma mixed {self.mix:.2f}"
        )


@functools.lru_cache(maxsize=None)
def _measured(path: str) -> IssueRates | None:
    r = dict(builds._ext.issue_rates())
    if r.get("lanes", 1) < 8:
        return None  # the generic build: no vector arithmetic to count
    vnni = "dpbusd" in r
    return IssueRates(
        r["clock_hz"],
        int(r["lanes"]),
        r["dpbusd" if vnni else "maddubs"],
        r["madd"],
        r["fma"],
        r["dot_fma_mix"],
        vnni,
        r.get("madd_add", 0.0),
        r.get("maddubs_add", 0.0),
    )


def issue_rates() -> IssueRates | None:
    """The build in use's rates on this CPU (measured once a process, ~0.3 s); None without vector kernels."""
    if not builds.AVAILABLE:
        return None
    return _measured(builds.PATH)


@dataclass(frozen=True)
class Work:
    """Arithmetic instructions of one row: integer dot products (with their widening) and fp32
    fma-class ones (conversions, scale products, fmas)."""

    dot: float = 0.0
    fma: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.dot + other.dot, self.fma + other.fma)

    def __mul__(self, k: float) -> "Work":
        return Work(self.dot * k, self.fma * k)

    def cycles(self, r: IssueRates) -> float:
        """One core's cycles for this work at the measured rates (module docstring)."""
        return max(self.dot / r.dot, self.fma / r.fma, (self.dot + self.fma) / r.mix)


def linear_work(w, r: IssueRates) -> Work:
    """One input row through the linear with weight `w` (a tensor, BlockWeight or InterleavedBF16)."""
    rows, cols = w.shape
    if not isinstance(w, BlockWeight) or w.activations == "float":
        return Work(fma=rows * cols / r.lanes)
    units = rows / r.lanes * cols / 32  # (lanes weight rows) x (a block of 32) each
    digits = 2 if w.activations == "int16" else 1
    scaling = 3 if w.fmt == "Q8_0" else 4  # conversion, scale product, fma (+ Q4's offset fma)
    # (counts in the time of the dot-product issue rate r.dot, so that Work.cycles holds)
    if digits == 2 and r.lanes == 8:
        # the AVX2 kernel for many rows: the 16-bit codes in 16 vpmaddwd, 2 elements each, each with
        # its vpaddd
        return Work(dot=units * 16 * r.dot / r.madd_pair, fma=units * scaling)
    if r.lanes == 8 and not r.vnni:  # AVX2, int8 activations: the products with their adds
        if w.fmt == "Q8_0":  # 8 vpmaddubsw (straight into the widening) and 8 vpmaddwd + vpaddd
            return Work(dot=units * (8 + 8 * r.dot / r.madd_pair), fma=units * scaling)
        # 7 vpmaddubsw + vpaddw (the 8 sums' tree), 1 alone, 1 widening vpmaddwd (into the conversion)
        return Work(dot=units * (7 * r.dot / r.maddubs_pair + 1 + r.dot / r.madd), fma=units * scaling)
    if w.fmt == "Q8_0":
        return Work(dot=units * digits * (8 if r.vnni else 16), fma=units * scaling)
    widen = 0 if r.vnni else (1 if r.lanes == 8 else 4)
    return Work(dot=units * digits * (8 + widen), fma=units * scaling)


def attention_work(n_heads: int, head_dim: int, keys: int, r: IssueRates) -> Work:
    """One row's attention in one layer over `keys` keys: scores and weighted values in fp32."""
    return Work(fma=2 * n_heads * head_dim * keys / r.lanes)


def ms(work: Work, r: IssueRates, threads: int) -> float:
    """The bound in ms of `work` split over `threads` cores."""
    return work.cycles(r) / r.clock_hz / max(1, threads) * 1e3
