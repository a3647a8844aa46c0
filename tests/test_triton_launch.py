"""library.quant.triton_launch: the direct launches of compiled Triton kernels, against a stand-in for Triton's
JITFunction / CompiledKernel (no GPU needed): what goes through Triton, what is launched directly, and with which
arguments."""

from __future__ import annotations

import types

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


class CudaLauncher:
    """Stands in for Triton's generic CudaLauncher (the layout of Triton 3.7+): its C `launch` records the call."""

    def __init__(self, log: list, refuse: bool = False, scratch: int = 0):
        self.log, self.refuse = log, refuse
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.arg_annotations, self.kernel_signature = ("annotations",), b"sig"
        self.launch = _CLaunch(log, refuse)

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, launch_enter_hook,
                 launch_exit_hook, *args):
        raise AssertionError("the raw launch must not go through CudaLauncher.__call__")


class _CLaunch:
    """A callable object (not a Python function: like the C launch function, unlike a Python wrapper)."""

    def __init__(self, log: list, refuse: bool):
        self.log, self.refuse = log, refuse

    def __call__(self, *args):
        if self.refuse:
            raise TypeError("launch() argument 14 must be bytes-like, not tuple")
        self.log.append(("raw", args))


class _CompiledWithLauncher(_Compiled):
    function = 1234
    packed_metadata = (4, 1, 0)

    def __init__(self, log: list, refuse_raw: bool = False, scratch: int = 0):
        super().__init__(log)
        self.run = CudaLauncher(log, refuse_raw, scratch)


class _JitRaw(_Jit):
    def __init__(self, refuse_raw: bool = False, scratch: int = 0):
        super().__init__()
        self.refuse_raw, self.scratch = refuse_raw, scratch

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _CompiledWithLauncher(self.log, self.refuse_raw, self.scratch)
        return run


@pytest.fixture
def fake_driver(monkeypatch):
    """A Triton stand-in whose active driver gives device 3 and stream 777, with no launch hooks registered."""
    driver = types.SimpleNamespace(get_current_device=lambda: 3, get_current_stream=lambda d: 777 if d == 3 else 0)
    hooks = types.SimpleNamespace(launch_enter_hook=TL_HookChain(), launch_exit_hook=TL_HookChain())
    monkeypatch.setattr(TL, "triton", types.SimpleNamespace(__version__="3.9.0",
                                                            runtime=types.SimpleNamespace(
                                                                driver=types.SimpleNamespace(active=driver))))
    monkeypatch.setattr(TL, "_knobs", types.SimpleNamespace(runtime=hooks))
    monkeypatch.setattr(TL, "_LAYOUT", {})
    return hooks


class TL_HookChain:
    def __init__(self):
        self.calls: list = []


def test_raw_launch_calls_the_c_launcher_with_fixed_metadata(fake_driver):
    fn = _JitRaw()
    launcher = TL.DirectLauncher(fn, {"EVEN": True, "BLOCK": 64}, {"num_warps": 4})
    x = torch.zeros(64)
    launcher((2, 1, 1), (x, 64, 1))
    launcher((5, 1, 1), (x, 64, 1))
    assert [entry[0] for entry in fn.log] == ["jit", "raw"]
    assert fn.log[1][1] == (5, 1, 1, 777, 1234, False, True, (4, 1, 0), None, None, None, None, None,
                            ("annotations",), b"sig", (x, 64, 1, 64, True))
    assert TL._LAYOUT[CudaLauncher] == "generic"


def test_raw_launch_off_uses_the_compiled_kernels_launcher(fake_driver):
    fn = _JitRaw()
    launcher = TL.DirectLauncher(fn, {"EVEN": True, "BLOCK": 64}, {})
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 64, 1))
    TL.set_raw_launch(False)
    launcher((1, 1, 1), (x, 64, 1))
    TL.set_raw_launch(True)
    launcher((1, 1, 1), (x, 64, 1))
    assert [entry[0] for entry in fn.log] == ["jit", "direct", "raw"]


def test_a_registered_launch_hook_keeps_the_normal_path(fake_driver):
    fn = _JitRaw()
    launcher = TL.DirectLauncher(fn, {"EVEN": True, "BLOCK": 64}, {})
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 64, 1))
    fake_driver.launch_enter_hook.calls.append(print)
    launcher((1, 1, 1), (x, 64, 1))
    assert [entry[0] for entry in fn.log] == ["jit", "direct"]


def test_scratch_memory_or_an_unknown_layout_means_no_raw_launch(fake_driver):
    fn = _JitRaw(scratch=128)
    launcher = TL.DirectLauncher(fn, {"EVEN": True, "BLOCK": 64}, {})
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 64, 1))
    launcher((1, 1, 1), (x, 64, 1))
    assert [entry[0] for entry in fn.log] == ["jit", "direct"]
    assert not launcher.raw


def test_a_refusing_raw_launch_falls_back_to_the_compiled_launcher(fake_driver):
    fn = _JitRaw(refuse_raw=True)
    launcher = TL.DirectLauncher(fn, {"EVEN": True, "BLOCK": 64}, {})
    x = torch.zeros(64)
    launcher((1, 1, 1), (x, 64, 1))
    launcher((1, 1, 1), (x, 64, 1))  # the raw launch raises TypeError: this call goes through kernel[grid]
    launcher((1, 1, 1), (x, 64, 1))
    assert [entry[0] for entry in fn.log] == ["jit", "direct", "direct"]
    assert not TL.raw_launch_enabled() and TL.direct_launch_enabled()


def test_the_v36_layout_needs_a_known_triton_version(fake_driver, monkeypatch):
    class V36(CudaLauncher):
        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            raise AssertionError("not called")

    V36.__name__ = "CudaLauncher"
    log: list = []
    assert TL._launcher_layout(V36(log)) is None  # 3.9 with the *args call: unknown
    monkeypatch.setattr(TL, "_LAYOUT", {})
    monkeypatch.setattr(TL.triton, "__version__", "3.6.0")
    kernel = types.SimpleNamespace(run=V36(log), function=99, packed_metadata=(8, 1, 512))
    launch = TL.raw_launcher(kernel, (64, True))
    x = torch.zeros(4)
    launch((7, 1, 1), (x, 3))
    expected = (7, 1, 1, 777, 99, False, True, None, None, (8, 1, 512), None, None, None, x, 3, 64, True)
    assert log == [("raw", expected)]
    # on a fixed grid (the launch plans' form): the same call, with the current device's or a given device's stream
    TL.raw_launcher(kernel, (64, True), (7, 1, 1))((x, 3))
    TL.raw_launcher(kernel, (64, True), (7, 1, 1), 3)((x, 3))
    TL.raw_launcher(kernel, (64, True), (7, 1, 1), 5)((x, 3))
    assert log[1:] == [("raw", expected), ("raw", expected), ("raw", (*expected[:3], 0, *expected[4:]))]


# ---------------------------------------------------------------------------------------------------------------
# TmaLauncher: raw launches of kernels that take host tensor descriptors (Triton 3.5-3.6 layout)
# ---------------------------------------------------------------------------------------------------------------
class _V36TmaLauncher(CudaLauncher):
    """Triton 3.6's CudaLauncher of a TMA kernel: `launch` is a Python wrapper closing over the C function."""

    def __init__(self, log: list, scratch: int = 0):
        super().__init__(log, scratch=scratch)
        launcher = _CLaunch(log, False)

        def inner(*args):  # Triton's wrapper; the raw path must bypass it
            raise AssertionError(f"the wrapper around {launcher} must not be called")

        self.launch = inner

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        raise AssertionError("not called")


_V36TmaLauncher.__name__ = "CudaLauncher"
_TMA_SIGNATURE = {"a_desc": "tensordesc<i8[64, 128]>", "b_desc": "tensordesc<i8[128, 128]>", "c_ptr": "*bf16",
                  "M": "i32", "BLOCK": "constexpr"}


def _tma_kernel(log: list, signature: dict = _TMA_SIGNATURE, metas: object = "two", scratch: int = 0):
    metas = [{"swizzle": 3}, {"swizzle": 3}] if metas == "two" else metas
    return types.SimpleNamespace(run=_V36TmaLauncher(log, scratch), function=42, packed_metadata=(8, 1, 0),
                                 src=types.SimpleNamespace(signature=signature),
                                 metadata=types.SimpleNamespace(tensordesc_meta=metas))


@pytest.fixture
def tma_driver(fake_driver, monkeypatch):
    """Triton 3.6 with a descriptor encoder that records what it encodes."""
    monkeypatch.setattr(TL.triton, "__version__", "3.6.0")
    encoded: list = []

    def expand(desc, meta):
        encoded.append((desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape)))
        return [("map", len(encoded)), *desc.shape, *desc.strides]

    monkeypatch.setattr(TL, "_tensordesc_expander", lambda: expand)
    return encoded


def test_tma_raw_launch_encodes_each_operand_once_and_calls_the_c_function(tma_driver):
    log: list = []
    tma = TL.TmaLauncher.of(_tma_kernel(log), (64,), ([64, 128], [128, 128]))
    assert tma is not None
    a, b, c = torch.zeros(32, 256, dtype=torch.int8), torch.zeros(48, 256, dtype=torch.int8), torch.zeros(4)
    descs = ((a, (32, 256), (256, 1)), (b, (48, 256), (256, 1)))
    tma((3, 1, 1), descs, (c, 32))
    tma((3, 1, 1), descs, (c, 32))
    assert [e[0] for e in tma_driver] == [a.data_ptr(), b.data_ptr()]  # encoded once each
    assert tma_driver[0][3] == (64, 128) and tma_driver[1][3] == (128, 128)
    expected = (3, 1, 1, 777, 42, False, True, None, None, (8, 1, 0), None, None, None,
                ("map", 1), 32, 256, 256, 1, ("map", 2), 48, 256, 256, 1, c, 32, 64)
    assert log == [("raw", expected), ("raw", expected)]
    a2 = torch.zeros(32, 512, dtype=torch.int8)[:, :256]  # another base and row stride: a new encoding for A only
    tma((3, 1, 1), ((a2, (32, 256), (512, 1)), descs[1]), (c, 32))
    assert len(tma_driver) == 3 and tma_driver[2][:3] == (a2.data_ptr(), (32, 256), (512, 1))


def test_tma_bound_launch_makes_the_same_call_with_b_encoded_once(tma_driver):
    log: list = []
    tma = TL.TmaLauncher.of(_tma_kernel(log), (64,), ([64, 128], [128, 128]))
    a, b, c = torch.zeros(32, 256, dtype=torch.int8), torch.zeros(48, 256, dtype=torch.int8), torch.zeros(4)
    tma((3, 1, 1), ((a, (32, 256), (256, 1)), (b, (48, 256), (256, 1))), (c, 32))
    launch = tma.bound_a((3, 1, 1), b, (48, 256), (256, 1), 3)
    launch(a, (32, 256), (256, 1), (c, 32))
    assert log[1] == log[0] and len(tma_driver) == 2  # nothing encoded again
    a2 = torch.zeros(32, 256, dtype=torch.int8)
    launch(a2, (32, 256), (256, 1), (c, 32))  # a new A: encoded once, B kept
    assert len(tma_driver) == 3 and tma_driver[2][0] == a2.data_ptr() and log[2][1][18:23] == log[0][1][18:23]
    assert tma.encodes == 3


def test_tma_raw_launch_cache_is_bounded(tma_driver, monkeypatch):
    monkeypatch.setattr(TL, "_TMA_CACHE_LIMIT", 2)
    tma = TL.TmaLauncher.of(_tma_kernel([]), (64,), ([64, 128], [128, 128]))
    b = torch.zeros(48, 256, dtype=torch.int8)
    for rows in (8, 16, 24):
        a = torch.zeros(rows, 256, dtype=torch.int8)
        tma((1, 1, 1), ((a, (rows, 256), (256, 1)), (b, (48, 256), (256, 1))), (b, rows))
    assert len(tma.cache) <= 2


@pytest.mark.parametrize("case", ["not_first", "no_meta", "scratch", "version", "no_wrapper"])
def test_tma_raw_launch_is_refused_where_the_layout_is_not_known(tma_driver, monkeypatch, case):
    kernel = {
        "not_first": lambda: _tma_kernel([], {"c_ptr": "*bf16", **_TMA_SIGNATURE}),
        "no_meta": lambda: _tma_kernel([], metas=None),
        "scratch": lambda: _tma_kernel([], scratch=64),
        "version": lambda: _tma_kernel([]),
        "no_wrapper": lambda: _tma_kernel([]),
    }[case]()
    if case == "version":
        monkeypatch.setattr(TL.triton, "__version__", "3.9.0")
    if case == "no_wrapper":
        kernel.run.launch = _CLaunch([], False)  # no Python wrapper to look under: not the 3.6 TMA layout
    assert TL.TmaLauncher.of(kernel, (64,), ([64, 128], [128, 128])) is None


def test_bound_is_the_launch_a_later_call_would_make(fake_driver):
    """`bound(grid, key)`: nothing before the specialisation's first launch; then its raw launch (or, with raw
    launches off, the compiled kernel's launcher; with direct launches off, nothing)."""
    fn = _JitRaw()
    launcher = TL.DirectLauncher(fn, {"EVEN": True, "BLOCK": 64}, {})
    x = torch.zeros(64)
    key = TL.spec_key((x, 64, 1))
    assert launcher.bound((2, 1, 1), key) is None
    launcher((2, 1, 1), (x, 64, 1))  # through Triton: compiles, keeps the raw launch
    launch = launcher.bound((4, 1, 1), key)
    launch((x, 80, 1))
    assert fn.log[-1][0] == "raw" and fn.log[-1][1][:5] == (4, 1, 1, 777, 1234)
    assert fn.log[-1][1][-1] == (x, 80, 1, 64, True)
    launcher.bound((4, 1, 1), key, device=5)((x, 80, 1))  # another device's current stream
    assert fn.log[-1][1][:5] == (4, 1, 1, 0, 1234)
    TL.set_raw_launch(False)
    launcher.bound((3, 1, 1), key)((x, 96, 1))
    assert fn.log[-1] == ("direct", (3, 1, 1), (x, 96, 1, 64, True))
    TL.set_direct_launch(False)
    assert launcher.bound((3, 1, 1), key) is None


def test_every_launch_switch_makes_bound_launches_stale():
    from library.quant import convrot_quant_kernels as QK
    from library.quant import fused_linear_kernels as FK
    from library.quant import int8_gemm_kernels as GK

    switches = (lambda: TL.set_direct_launch(True), lambda: TL.set_raw_launch(True),
                lambda: QK.set_quantiser(QK._TUNING["quantiser"]), lambda: QK.set_row_tuning(),
                lambda: GK.set_gemm_kernel(GK._TUNING["gemm"]), GK.clear_gemm_plans,
                lambda: GK.set_gemm_table("none"), lambda: FK.set_fused_linear(FK._FUSED["max_m"]),
                lambda: GK.set_backward_kernel(GK._TUNING["backward"]))
    try:
        for switch in switches:
            before = TL.plan_epoch()
            switch()
            assert TL.plan_epoch() != before, switch
    finally:
        GK.set_gemm_table(None)
