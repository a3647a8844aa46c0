"""library.quant.triton_launch: the direct launches of compiled Triton kernels, against a stand-in for Triton's
JITFunction / CompiledKernel (no GPU needed): what goes through Triton, what is launched directly, and with which
arguments."""

from __future__ import annotations

import pytest
import torch

from library.quant import triton_launch as TL


class _Compiled:
    """Stands in for triton.compiler.CompiledKernel: `kernel[grid](*args)` records the launch."""

    function = object()

    def __init__(self, log: list, refuse: bool = False):
        self.log, self.refuse = log, refuse

    def __getitem__(self, grid):
        def runner(*args):
            if self.refuse:
                raise TypeError("function takes exactly 12 arguments (14 given)")
            self.log.append(("direct", grid, args))
        return runner


class _Jit:
    """Stands in for a @triton.jit function with three runtime and two constexpr parameters."""

    arg_names = ("x_ptr", "n", "stride", "BLOCK", "EVEN")

    def __init__(self, refuse: bool = False):
        self.log: list = []
        self.refuse = refuse

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log, self.refuse)
        return run


@pytest.fixture(autouse=True)
def _fresh_state():
    saved = dict(TL._STATE)
    yield
    TL._STATE.update(saved)


def test_first_call_per_specialisation_goes_through_triton_then_direct():
    fn = _Jit()
    launcher = TL.DirectLauncher(fn, {"EVEN": True, "BLOCK": 64}, {"num_warps": 4})
    x = torch.zeros(64)
    launcher((2, 1, 1), (x, 64, 1))
    launcher((2, 1, 1), (x, 64, 1))
    launcher((3, 1, 1), (x, 17, 1))  # 17 is not a multiple of 16: another specialisation, through Triton again
    launcher((3, 1, 1), (x, 33, 1))  # the same specialisation as 17: direct
    kinds = [entry[0] for entry in fn.log]
    assert kinds == ["jit", "direct", "jit", "direct"]
    assert fn.log[0][3] == {"EVEN": True, "BLOCK": 64, "num_warps": 4}
    # direct launches pass the constexprs positionally, in the kernel's parameter order
    assert fn.log[1][2] == (x, 64, 1, 64, True) and fn.log[3][2] == (x, 33, 1, 64, True)
    assert fn.log[3][1] == (3, 1, 1)


def test_caller_key_replaces_the_generic_specialisation():
    fn = _Jit()
    launcher = TL.DirectLauncher(fn, {"BLOCK": 64, "EVEN": False}, {})
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 64, 1), key=("a",))
    launcher((1, 1, 1), (x, 5, 1), key=("a",))
    launcher((1, 1, 1), (x, 64, 1), key=("b",))
    assert [entry[0] for entry in fn.log] == ["jit", "direct", "jit"]


def test_spec_key_follows_triton_specialisation():
    base = torch.zeros(64, dtype=torch.float32)
    assert TL.spec_key((1,)) != TL.spec_key((2,))  # 1 is specialised
    assert TL.spec_key((32,)) == TL.spec_key((48,))  # both multiples of 16
    assert TL.spec_key((32,)) != TL.spec_key((40,))
    assert TL.spec_key((2**31,)) != TL.spec_key((16,))  # 64-bit integer
    assert TL.spec_key((base,)) != TL.spec_key((base[1:],))  # 4-byte offset: not 16-byte aligned
    assert TL.spec_key((base,)) == TL.spec_key((base[4:],))
    assert TL.spec_key((base,)) != TL.spec_key((base.to(torch.float16),))
    assert TL.spec_key((None,)) == (None,)


def test_a_refusing_launcher_falls_back_to_triton_for_good():
    fn = _Jit(refuse=True)
    launcher = TL.DirectLauncher(fn, {"BLOCK": 64, "EVEN": False}, {})
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 64, 1))
    launcher((1, 1, 1), (x, 64, 1))  # the direct launch raises TypeError: this call is re-launched through Triton
    launcher((1, 1, 1), (x, 64, 1))
    assert [entry[0] for entry in fn.log] == ["jit", "jit", "jit"]
    assert not TL.direct_launch_enabled()


def test_disabled_means_every_call_through_triton():
    fn = _Jit()
    launcher = TL.DirectLauncher(fn, {"BLOCK": 64, "EVEN": False}, {})
    TL.set_direct_launch(False)
    x = torch.zeros(64)
    for _ in range(3):
        launcher((1, 1, 1), (x, 64, 1))
    assert [entry[0] for entry in fn.log] == ["jit"] * 3


def test_constexprs_must_be_the_trailing_parameters():
    with pytest.raises(ValueError, match="trailing"):
        TL.DirectLauncher(_Jit(), {"n": 3, "EVEN": True}, {})
