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


def test_categories():
    assert gpu_profile.category("_int8_gemm_tma_kernel") == "int8_gemm"
    assert gpu_profile.category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop") == "attention"
    assert gpu_profile.category("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN") == "bf16_gemm"
    assert gpu_profile.category("something_else") == "other"
    assert gpu_profile.category("triton_poi_fused_add_cat_mul_silu_silu_backward_view_2") == "inductor_fused"
    assert gpu_profile.category("triton_red_fused__fused_rms_norm__to_copy__unsafe_view_5") == "inductor_fused"
    assert gpu_profile.category("Memcpy HtoD (Pageable -> Device)") == "copy"
