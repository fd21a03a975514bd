"""The command lines' range-checked argument types (sim/cli_types.py), through argparse as the CLIs use
them: every value in range parses to itself; anything else (out of range, NaN, infinities, words) is
refused with the range and the value in the message, and argparse exits 2 naming the flag."""

from __future__ import annotations

import argparse
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.spec import MAX_SEED
from sim import cli_types
from sim.cli_types import float_in, int_in


def _parser(**kw: object) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=True)
    p.add_argument("--x", **kw)  # type: ignore[arg-type]
    return p


def _refused(p: argparse.ArgumentParser, text: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        p.parse_args([f"--x={text}"])  # the = form: argparse takes "-inf" for a flag otherwise
    assert e.value.code == 2
    return capsys.readouterr().err


@given(st.integers(min_value=-(2**70), max_value=2**70))
def test_int_in_takes_exactly_its_range(v: int) -> None:
    parse = int_in(-3, 1000)
    if -3 <= v <= 1000:
        assert parse(str(v)) == v
    else:
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be an integer -3\.\.1000, got "):
            parse(str(v))


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_float_in_takes_finite_values_in_its_range(v: float) -> None:
    closed, open_lo = float_in(0, 10), float_in(0, 10, lo_open=True, hi_open=True)
    for parse, inside in ((closed, 0 <= v <= 10), (open_lo, 0 < v < 10)):
        if math.isfinite(v) and inside:
            assert parse(repr(v)) == v
        else:
            with pytest.raises(argparse.ArgumentTypeError, match="must be a number in"):
                parse(repr(v))


@pytest.mark.parametrize("text", ["-1", "4294967296", "1e3", "seven", "", " ", "0x10", "3.0"])
def test_a_bad_seed_exits_2_naming_the_flag_and_the_range(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(_parser(type=cli_types.seed), text, capsys)
    assert f"argument --x: must be an integer 0..{MAX_SEED}, got {text!r}" in err


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "1e400", "-0.5", "1", "x"])
def test_a_bad_number_exits_2_with_the_interval(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(_parser(type=float_in(0, 1, hi_open=True)), text, capsys)
    assert f"argument --x: must be a number in [0, 1), got {text!r}" in err


def test_bounds_print_as_people_write_them() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"in \(0, 16777216\], got"):
        float_in(0, 2**24, lo_open=True)("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"in \[0\.5, inf\], got"):
        float_in(0.5)("0.25")
    with pytest.raises(ValueError, match="empty range"):
        int_in(2, 1)


def test_the_extremes_of_each_shared_type_parse() -> None:
    assert cli_types.seed("0") == 0 and cli_types.seed(str(MAX_SEED)) == MAX_SEED
    assert cli_types.requests("1") == 1 and cli_types.jobs("1024") == 1024
