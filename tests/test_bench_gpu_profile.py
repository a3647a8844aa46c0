"""bench.gpu_profile's bookkeeping on recorded kernel intervals (the profiler itself needs a GPU)."""

from types import SimpleNamespace

from bench import gpu_profile


def _kernel(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_busy_time_counts_overlapping_kernels_once():
    assert gpu_profile._union_us([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert gpu_profile._union_us([(3, 4)]) == 1


def test_largest_gaps_name_the_kernels_around_them():
    kernels = [_kernel("a", 0, 10), _kernel("b", 5, 30), _kernel("c", 40, 50), _kernel("d", 51, 60),
               _kernel("e", 160, 170)]
    gaps = gpu_profile._largest_gaps(kernels, top=2)
    assert gaps == [{"us": 100.0, "after": "d", "before": "e"}, {"us": 10.0, "after": "b", "before": "c"}]


def test_idle_time_by_gap_length():
    """Idle time split into gaps between queued kernels (<= 5 us), short stalls, and waits on the host; per call."""
    kernels = [_kernel("a", 0, 10), _kernel("b", 12, 20), _kernel("c", 5, 25), _kernel("d", 28, 30),
               _kernel("e", 60, 70), _kernel("f", 370, 380), _kernel("g", 1380, 1390)]
    rows = gpu_profile._idle_by_gap(sorted(kernels, key=lambda e: e.time_range.start), steps=2)
    assert [r["gaps"] for r in rows] == ["<= 5 us", "<= 50 us", "<= 500 us", "> 500 us"]
    # gaps: 25 -> 28 (3 us), 30 -> 60 (30), 70 -> 370 (300), 380 -> 1380 (1000); c covers 10 -> 12
    assert [(r["idle_ms"], r["count"]) for r in rows] == [(0.002, 0.5), (0.015, 0.5), (0.15, 0.5), (0.5, 0.5)]  # rounded


def test_categories():
    assert gpu_profile.category("_int8_gemm_tma_kernel") == "int8_gemm"
    assert gpu_profile.category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert gpu_profile.category("sm90_xmma_fprop_implicit_gemm_f32f32_tf32f32_f32_nhwckrsc_nhwc_cudnn") == "convolution"
    assert gpu_profile.category("void cudnn::engines_precompiled::nchwToNhwcKernel<float, float>") == "convolution"
    assert gpu_profile.category("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "bf16_gemm"
    assert gpu_profile.category("something_else") == "other"
    assert gpu_profile.category("triton_poi_fused_add_cat_mul_silu_silu_backward_view_2") == "inductor_fused"
    assert gpu_profile.category("triton_red_fused__fused_rms_norm__to_copy__unsafe_view_5") == "inductor_fused"
    assert gpu_profile.category("Memcpy HtoD (Pageable -> Device)") == "copy"
    assert gpu_profile.category("_norm_modulate_quant_kernel") == "fused_elementwise"
    assert gpu_profile.category("_swiglu_fwd_kernel") == "fused_elementwise"
    assert gpu_profile.category("_int8_gemm_epilogue_kernel") == "int8_gemm"


def test_host_threads_split_the_operators_by_thread_and_name_the_autograd_nodes():
    import torch

    cpu = torch.autograd.DeviceType.CPU

    def event(name, thread, start, end, own, parent=None):
        return SimpleNamespace(name=name, thread=thread, device_type=cpu, cpu_parent=parent,
                               time_range=SimpleNamespace(start=start, end=end), self_cpu_time_total=own,
                               cpu_time_total=end - start)

    node = event("autograd::engine::evaluate_function: LoRAGroupBackward", 2, 0, 3000, 1000)
    events = [event("aten::mm", 1, 0, 1000, 1000), event("aten::mm", 1, 500, 1500, 1000),
              node, event("aten::addmm_", 2, 100, 2100, 2000, parent=node),
              SimpleNamespace(name="kernel", thread=2, device_type=torch.autograd.DeviceType.CUDA, cpu_parent=None,
                              time_range=SimpleNamespace(start=0, end=9000), self_cpu_time_total=0,
                              cpu_time_total=0)]
    rows = gpu_profile._host_threads(events, steps=1)
    assert [r["thread"] for r in rows] == [2, 1]  # the busier thread first; the kernel is no host operator
    assert rows[0]["covered_ms"] == 3.0 and rows[1]["covered_ms"] == 1.5
    assert rows[0]["top_own_ms"][0] == {"name": "aten::addmm_", "ms": 2.0, "calls": 1}
    assert rows[0]["top_nodes_ms"] == [{"name": "LoRAGroupBackward", "ms": 3.0, "calls": 1}]
    assert rows[1]["top_own_ms"] == [{"name": "aten::mm", "ms": 2.0, "calls": 2}]
