"""The profile's table by kernel kind (src/moetrain/train/profiling.py, `kernel_kinds`), on kernel
names as the H200 profiles of docs/benchmarks.md show them."""

from types import SimpleNamespace

import torch

from moetrain.train.profiling import STAND_INS, kernel_kinds, stand_in_kernels

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def event(name, us, device=CUDA, annotation=False):
    return SimpleNamespace(key=name, self_device_time_total=us, device_type=device, is_user_annotation=annotation)


def test_kernels_are_sorted_into_kinds_once_each():
    events = [
        event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 4000),  # dense bf16 GEMM
        event("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2", 1000),  # FP8 _scaled_mm
        event(
            "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::"
            "kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >",
            3000,
        ),
        event("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3", 2000),
        event("_adamw_kernel", 1500),
        event("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", 500),
        event("triton_poi_fused__to_copy_index_select_mul_unsqueeze_view_3", 600),
        event("triton_red_fused__to_copy_abs_amax_ceil_clamp_div_exp2_gt_0", 400),
        event("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 800),
        event("aten::mm", 4000, CPU),  # the operator row: not a kernel, not counted again
        # ranges on the GPU timeline, not kernels: the step, and a compiled graph's annotation
        event("ProfilerStep*", 40000, annotation=True),
        event("## Call CompiledFxGraph fcpkgtneh6eaxkv7gh62kryavhiaco74k ##", 7000, annotation=True),
        event("## Call CompiledFxGraph figdqw2p4talmqa7kscgvmj4za52haqa5 ##", 6000),  # flagged or not
    ]
    kinds = kernel_kinds(events, steps=2)
    assert kinds == {
        "communication": 0.4,
        "attention": 1.0,
        "AdamW": 1.0,
        "grouped GEMM": 1.5,
        "dense GEMM": 2.5,
        "everything else": 0.5,
        "total": 6.9,
    }


def cpu_op(name, kernels=(), children=()):
    return SimpleNamespace(
        name=name,
        device_type=CPU,
        kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels],
        cpu_children=list(children),
    )


def test_a_rehearsals_stand_in_kernels_leave_their_kinds_and_the_total():
    """The copies and scales a stand-in collective makes (inside its rehearsal:OP range, at any
    depth) are no rank's work: out of their kinds and the total, listed apart."""
    copy = "void at::native::elementwise_kernel<128, 2, at::native::direct_copy_kernel_cuda>"
    scale = "void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float>>"
    events = [
        cpu_op("rehearsal:all_to_all", children=[cpu_op("aten::copy_", [(copy, 300)])]),
        cpu_op("rehearsal:all_reduce", children=[cpu_op("aten::mul_", [(scale, 100)])]),
        cpu_op("aten::copy_", [(copy, 5000)]),  # the rank's own copy: stays
    ]
    stand_ins = stand_in_kernels(events)
    assert stand_ins == {copy: 300, scale: 100}
    averages = [event(copy, 5300), event(scale, 100), event("nvjet_sm90_tst_256x128", 2000)]
    kinds = kernel_kinds(averages, steps=1, stand_ins=stand_ins)
    assert kinds["everything else"] == 5.0 and kinds["dense GEMM"] == 2.0 and kinds["total"] == 7.0
    assert kinds[STAND_INS] == 0.4
    assert STAND_INS not in kernel_kinds(averages, steps=1)
