"""Kernel-name normalisation: NCCL old and new spellings, library families, bounded output."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepwatch.core._schema import KERNEL_CATEGORIES
from stepwatch.exporters.kernels import KernelClass, classify_kernel


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        # NCCL < 2.19 names, with and without argument lists.
        ("ncclKernel_AllReduce_RING_LL_Sum_float", ("nccl_allreduce", "communication")),
        (
            "ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)",
            ("nccl_allreduce", "communication"),
        ),
        (
            "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
            ("nccl_sendrecv", "communication"),
        ),
        ("ncclKernel_AllGather_RING_LL_Sum_int8_t", ("nccl_allgather", "communication")),
        ("ncclKernel_ReduceScatter_RING_SIMPLE_Sum_half", ("nccl_reducescatter", "communication")),
        # NCCL >= 2.19 names (HTA's categoriser misses these).
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", ("nccl_allreduce", "communication")),
        (
            "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            ("nccl_allgather", "communication"),
        ),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", ("nccl_reducescatter", "communication")),
        ("ncclDevKernel_Broadcast_RING_LL", ("nccl_broadcast", "communication")),
        (
            "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
            ("nccl_sendrecv", "communication"),
        ),
        (
            "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)",
            ("nccl_generic", "communication"),
        ),
        (
            "void ncclDevKernel_Generic_4(ncclDevKernelArgsStorage<4096ul>)",
            ("nccl_generic", "communication"),
        ),
        # CPU-side collectives.
        ("nccl:all_reduce", ("nccl_allreduce", "communication")),
        ("nccl:_all_gather_base", ("nccl_allgather", "communication")),
        ("nccl:all_to_all", ("nccl_alltoall", "communication")),
        ("c10d::allreduce_", ("c10d_allreduce", "communication")),
        ("c10d::_allgather_base_", ("c10d_allgather", "communication")),
        ("gloo:all_reduce", ("gloo_allreduce", "communication")),
        ("gloo:broadcast", ("gloo_broadcast", "communication")),
        ("record_param_comms", ("record_param_comms", "communication")),
        # Memory activity.
        ("Memcpy HtoD (Pageable -> Device)", ("memcpy_htod", "memory")),
        ("Memcpy DtoH (Device -> Pinned)", ("memcpy_dtoh", "memory")),
        ("Memcpy DtoD (Device -> Device)", ("memcpy_dtod", "memory")),
        ("Memcpy PtoP (Device -> Device)", ("memcpy_ptop", "memory")),
        ("Memset (Device)", ("memset", "memory")),
        # cuBLAS / cuBLASLt / CUTLASS gemm families.
        ("volta_sgemm_128x32_nt", ("gemm", "compute")),
        ("ampere_sgemm_32x128_tn", ("gemm", "compute")),
        (
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1",
            ("gemm", "compute"),
        ),
        (
            "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x128_32x5_tn_align4>"
            "(cutlass_80_tensorop_s1688gemm_128x128_32x5_tn_align4::Params)",
            ("gemm", "compute"),
        ),
        (
            "void gemmSN_TN_kernel<float, 128, 16, 2, 4, 8, 9, false, "
            "cublasGemvTensorStridedBatched<float const> >(cublasGemmSmallNParams<float>)",
            ("gemm", "compute"),
        ),
        (
            "void splitKreduce_kernel<32, 16, int, float>(cublasSplitKParams<float>)",
            ("gemm", "compute"),
        ),
        # cuDNN convolutions, even the implicit-gemm ones.
        (
            "void cudnn::detail::implicit_convolve_sgemm<float, float, 128, 5>(int, int)",
            ("conv", "compute"),
        ),
        ("sm80_xmma_fprop_implicit_gemm_indexed_tf32f32", ("conv", "compute")),
        (
            "void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>()",
            ("conv", "compute"),
        ),
        # Other families.
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float> >"
            "(int)",
            ("elementwise", "compute"),
        ),
        (
            "void (anonymous namespace)::softmax_warp_forward<float, float, float, 1>(float*)",
            ("softmax", "compute"),
        ),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float> >(float)",
            ("reduce", "compute"),
        ),
        ("void fbgemm_gpu::permute_2D_lengths_kernel<int>(int, int)", ("embedding", "compute")),
        (
            "void at::native::(anonymous namespace)::LayerNormForwardCUDAKernel<float, float>"
            "(long)",
            ("norm", "compute"),
        ),
        (
            "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 2>"
            "(float*)",
            ("cat", "memory"),
        ),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int> >(int)",
            ("fill", "memory"),
        ),
        (
            "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64> >(Flash_fwd_params)",
            ("attention", "compute"),
        ),
        # ATen CPU ops.
        ("aten::addmm", ("gemm", "compute")),
        ("aten::conv2d", ("conv", "compute")),
        ("aten::copy_", ("copy", "memory")),
        ("aten::add_", ("add", "compute")),
        ("aten::add", ("add", "compute")),
        ("aten::relu", ("relu", "compute")),
        # Autograd's AccumulateGrad node: its self time is the gradient hooks (DDP's reducer).
        ("torch::autograd::AccumulateGrad", ("torch::autograd::AccumulateGrad", "other")),
        ("AddmmBackward0", ("AddmmBackward0", "compute")),
        # Fallback: bare function name, templates / args / addresses / launch config stripped.
        (
            "void my_ns::custom_kernel<float, 4>(float*, int) [clone .kd]",
            ("my_ns::custom_kernel", "compute"),
        ),
        (
            "void bounds_check_indices_kernel<long>(at::GenericPackedTensorAccessor<long>)",
            ("bounds_check_indices_kernel", "compute"),
        ),
        ("my_kernel_64x128x32 @ 0x7f3a2b1c", ("my_kernel", "compute")),
        ("cudaLaunchKernel", ("cudaLaunchKernel", "other")),
    ],
)
def test_classify(raw: str, expected: tuple[str, str]) -> None:
    assert classify_kernel(raw) == KernelClass(*expected)


def test_same_kernel_different_template_arguments_is_one_class() -> None:
    a = classify_kernel("void my_kernel<float, 128>(float*, int)")
    b = classify_kernel("void my_kernel<__half, 256>(__half*, int)")
    assert a == b == KernelClass("my_kernel", "compute")


@settings(deadline=None, derandomize=True)  # reproducible, and never flaky on a loaded CI box
@given(st.text(max_size=300))
def test_any_name_gives_a_bounded_class_and_a_known_category(raw: str) -> None:
    result = classify_kernel(raw)
    assert 0 < len(result.name) <= 64
    assert result.category in KERNEL_CATEGORIES
    assert result.name != "other"  # reserved for folded classes


@settings(deadline=None, derandomize=True)  # reproducible, and never flaky on a loaded CI box
@given(
    st.text(alphabet="abcdefgh_:", min_size=1, max_size=40),
    st.text(alphabet="ifdlb ,*<>", max_size=40),
)
def test_arguments_never_change_the_class(function: str, arguments: str) -> None:
    # Whatever follows the name in parentheses (an argument list) is ignored.
    bare = classify_kernel(f"void {function}()")
    assert classify_kernel(f"void {function}({arguments})") == bare
