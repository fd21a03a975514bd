"""Range-checked argument types for the command lines (``controllerctl``, its ``sim`` / ``trace`` /
``profile`` commands, the benchmarks), and the parser class whose usage errors are one line.

Each type parses one value and refuses anything outside its range, NaN and infinities included, with
the range in the message, so argparse exits 2 naming the flag (``argument --seed: must be an integer
0..4294967295, got '-5'``) before anything runs. A plain ``type=int`` lets ``--seed -5`` through to
numpy, which raised a traceback deep inside the run. ``controller`` imports these too (it may import
``sim``; ``sim`` never imports ``controller``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

from policies.spec import MAX_SEED


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _interval(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    left = "(" if lo_open else "["
    right = ")" if hi_open else "]"
    return f"{left}{'-inf' if lo is None else _num(lo)}, {'inf' if hi is None else _num(hi)}{right}"


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An integer ``lo..hi`` (both included)."""
    if lo > hi:
        raise ValueError(f"int_in: empty range {lo}..{hi}")

    def parse(text: str) -> int:
        try:
            v = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {lo}..{hi}, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be an integer {lo}..{hi}, got {text!r}")
        return v

    parse.__name__ = f"integer {lo}..{hi}"
    return parse


def float_in(
    lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    """A finite number between ``lo`` and ``hi`` (None: unbounded on that side; ``*_open``: the bound
    itself excluded)."""
    where = _interval(lo, hi, lo_open, hi_open)

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {where}, got {text!r}") from None
        below = lo is not None and (v <= lo if lo_open else v < lo)
        above = hi is not None and (v >= hi if hi_open else v > hi)
        if not math.isfinite(v) or below or above:
            raise argparse.ArgumentTypeError(f"must be a number in {where}, got {text!r}")
        return v

    parse.__name__ = f"number in {where}"
    return parse


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, naming the command and the flag
    (``controllerctl sim tune: error: argument --jobs: must be an integer 1..1024, got '0'``), exit 2.
    argparse prints the whole usage first: up to a dozen lines in which the one that matters was last.
    Its sub-command parsers are of this class too (``add_subparsers`` makes them with the parent's)."""

    def error(self, message: str) -> NoReturn:
        text = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {text} (see {self.prog} --help)\n")


#: ``--seed``: what a policy's seed takes (numpy seeds its generators from 32-bit words).
seed = int_in(0, MAX_SEED)
#: Requests generated for ``--scenario`` (or a benchmark's traffic) in all: a generated request holds
#: its acceptance arrays, about 28 kB, so 10^6 took 28 GB and was killed for memory.
MAX_GENERATED_REQUESTS = 100_000
#: ``--requests``: requests to generate.
requests = int_in(1, MAX_GENERATED_REQUESTS)
#: ``--jobs``: worker processes of a sweep.
jobs = int_in(1, 1024)

__all__ = ["MAX_GENERATED_REQUESTS", "OneLineParser", "float_in", "int_in", "jobs", "requests", "seed"]
