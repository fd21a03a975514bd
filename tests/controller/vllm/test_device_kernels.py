"""The device drafter's Triton kernels compile for the GPUs vLLM serves on, here, without a GPU.

Triton's interpreter (which the drafter tests run them in) is lenient where the compiler is not (a global
that is not a ``tl.constexpr``, mixed integer widths in a loop's bounds, a scalar where a mask goes), so
each kernel is also compiled, through PTX to a cubin with the ptxas that Triton ships, for Ampere and
Hopper, with every token dtype the runner hands over and ``max_n`` at the ends the settings allow. In a
child process: Triton reads ``TRITON_INTERPRET`` once, at import, and the drafter tests import it
interpreted. Where the kernels run is for ``scripts/gpu_check.sh``; that they build is checked here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.e2e.harness import checkout_pythonpath

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (vLLM's environment has it)", allow_module_level=True)

_COMPILE = r"""
import itertools, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from controller.vllm import device_kernels as dk

append, match = dk.kernels()
done = []
for arch, tok in itertools.product((80, 90), ("*i32", "*i64")):
    sig = {"hist": "*i32", "hist_stride": "i32", "lens": "*i64", "tok": tok, "tok_stride": "i32",
           "slots": "*i64", "width": "i32", "max_model_len": "i32", "BLOCK_W": "constexpr"}
    k = triton.compile(ASTSource(fn=append, signature=sig, constexprs={"BLOCK_W": dk.APPEND_BLOCK}),
                       target=GPUTarget("cuda", arch, 32))
    done.append(["append", arch, tok, ".entry _append_rows" in k.asm["ptx"], len(k.asm["cubin"])])
for arch, out, (max_n, cols) in itertools.product((80, 90), ("*i32", "*i64"), ((1, 1), (5, 4), (64, 64))):
    sig = {"hist": "*i32", "hist_stride": "i32", "lens": "*i64", "slots": "*i64", "rows": "*i64", "out": out,
           "out_stride": "i32", "cols": "i32", "min_n": "i32", "room_max": "i32", "max_model_len": "i32",
           "MAX_N": "constexpr", "BLOCK_P": "constexpr", "BLOCK_K": "constexpr"}
    consts = {"MAX_N": max_n, "BLOCK_P": dk.BLOCK, "BLOCK_K": triton.next_power_of_2(cols)}
    k = triton.compile(ASTSource(fn=match, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32))
    done.append(["match", arch, out, ".entry _match_rows" in k.asm["ptx"], len(k.asm["cubin"])])
print(json.dumps(done))
"""


def test_the_kernels_compile_to_cubins_for_ampere_and_hopper() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = checkout_pythonpath()
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (silences a warning; the kernels do no float maths)
    r = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(done) == 4 + 12
    for name, arch, dtype, entry, cubin in done:
        assert entry and cubin > 0, (name, arch, dtype)
