"""The fast path's float text (its own shortest-digits routine) is repr(), value for value.

The converter writes every float field with ``_fastpath``'s routine (Schubfach's shortest
decimal, laid out as CPython's repr()); the Python converter writes repr(). They must agree
on every double: random bit patterns over the whole range, the kinds of values the exporters
send (durations from nanosecond clocks, their sums), every power of two and of ten with its
neighbours (every binary exponent, both interval shapes), subnormals and the extremes.
"""

from __future__ import annotations

import math
import random
import struct
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.otel_bridge import _fast
from tests.c_extensions import needs

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "otel_bridge" / "csrc"

pytestmark = needs(_fast.AVAILABLE, "the bridge's C fast path")


def _format(value: float) -> str:
    from stepwatch.otel_bridge import _fastpath

    return _fastpath.format_float(value)  # type: ignore[no-any-return]


def _from_bits(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]  # type: ignore[no-any-return]


def _mismatches(values: list[float]) -> list[tuple[str, str]]:
    return [(repr(v), _format(v)) for v in values if _format(v) != repr(v)]


def test_the_powers_of_ten_table_is_the_generators_output() -> None:
    generated = subprocess.run(
        [sys.executable, str(CSRC / "gen_pow10.py")], check=True, capture_output=True, text=True
    ).stdout
    assert (CSRC / "pow10.h").read_text() == generated


def test_the_fixed_point_logarithms_are_exact_over_the_exponents() -> None:
    """The constants fastpath.c uses for floor(q log10 2), floor(log10(3/4 2**q)) and
    floor(e log2 10), checked with exact rational arithmetic over every exponent it meets."""
    two, ten = Fraction(2), Fraction(10)
    for q in range(-1100, 1100):
        k = (q * 661971961083) >> 41
        assert ten**k <= two**q < ten ** (k + 1), q
        k = (q * 661971961083 - 274743187321) >> 41
        assert ten**k <= Fraction(3, 4) * two**q < ten ** (k + 1), q
    for e in range(-400, 400):
        f = (e * 913124641741) >> 38
        assert two**f <= ten**e < two ** (f + 1), e


def test_random_bit_patterns_and_exporter_values() -> None:
    rng = random.Random(20261126)
    values = [_from_bits(rng.getrandbits(64)) for _ in range(200_000)]
    values += [rng.random() for _ in range(50_000)]
    values += [rng.randrange(1, 10**12) / 1e9 for _ in range(50_000)]  # ns durations in s
    values += [sum(rng.randrange(1, 10**9) / 1e9 for _ in range(5)) for _ in range(20_000)]
    values += [rng.random() * 10 ** rng.randrange(-30, 30) for _ in range(50_000)]
    finite = [v for v in values if math.isfinite(v)]
    assert _mismatches(finite) == []


def test_every_binary_exponent_and_the_powers_of_ten() -> None:
    values: list[float] = []
    for exponent in range(-1074, 1024):
        x = math.ldexp(1.0, exponent)  # a power of two: the narrower interval below
        values += [x, math.nextafter(x, 0.0), math.nextafter(x, math.inf), -x]
        values.append(math.ldexp(1.5, exponent) if exponent < 1023 else x)
    for exponent in range(-324, 309):
        x = float(f"1e{exponent}")
        values += [x, math.nextafter(x, 0.0), math.nextafter(x, math.inf)]
        values += [float(f"{d}e{exponent}") for d in (2, 5, 9.5)]
    finite = [v for v in values if math.isfinite(v) and v != 0.0]
    assert _mismatches(finite) == []


def test_subnormals_extremes_and_special_values() -> None:
    values = [_from_bits(bits) for bits in range(1, 20_000)]  # the smallest subnormals
    values += [_from_bits((1 << 52) - bits) for bits in range(1, 20_000)]  # below the normals
    values += [_from_bits((1 << 52) + bits) for bits in range(0, 2_000)]
    values += [sys.float_info.max, -sys.float_info.max, sys.float_info.min, 5e-324]
    values += [2.0**53 + 2, 2.0**53 - 1, 1e16, 1e16 + 2, 123456789012345678.0, 0.1, 0.3]
    values += [1e-4, 1e-5, 9.999999999999999e-5, 1e15 + 0.5, 1e17, 9007199254740993.0]
    values += [0.0, -0.0, math.inf, -math.inf, 1.0, -1.0, 100.0, 1e22, 1e23, 2e23]
    assert _mismatches(values) == []
    assert _format(math.nan) == "nan"


@settings(max_examples=3000, deadline=None)
@given(st.floats(allow_nan=False))
def test_any_double(value: float) -> None:
    assert _format(value) == repr(value)
