"""Kernel-name normalisation: raw CUDA kernel / CPU op names → bounded ``(class, category)``.

One function, :func:`classify_kernel`, serves every source (CUPTI records, torch.profiler CPU
ops, recorded Kineto traces), so the same kernel gets the same ``stepwatch.kernel.class``
whichever way it was observed. Rules, in order:

1. NCCL device kernels, old (``ncclKernel_AllReduce_RING_LL_Sum_float``) and new
   (``ncclDevKernel_AllReduce_Sum_f32_RING_LL``, ``ncclDevKernel_Generic``) spellings, and the
   CPU-side collectives (``nccl:all_reduce``, ``c10d::allreduce_``, ``gloo:all_reduce``,
   ``record_param_comms``) → ``nccl_<op>`` / ``<backend>_<op>``, category ``communication``.
   HTA's kernel categoriser misses the new spelling; this one takes both.
2. CUPTI memcpy / memset activities (``Memcpy HtoD (Pageable -> Device)``, ``Memset (Device)``)
   → ``memcpy_htod`` / ``memcpy_dtoh`` / ``memcpy_dtod`` / ``memcpy_ptop`` / ``memset``,
   category ``memory``.
3. Library families (cuBLAS / cuBLASLt / CUTLASS gemm and gemv → ``gemm``; cuDNN convolutions →
   ``conv``; ``softmax``, ``norm``, ``attention``, ``reduce``, ``scan``, ``sort``, ``embedding``,
   ``index``, ``elementwise``; copy / fill / cat kernels → category ``memory``).
4. ATen CPU ops (``aten::add_``) → the op name without namespace and in-place suffix (``add``).
5. Autograd's ``torch::autograd::AccumulateGrad`` node (CPU profiles) → category ``other``: the
   accumulation is its child ops, so its self time is the gradient hooks it runs (DDP's
   reducer filling buckets and launching the all-reduce, a comm hook), host work that waits
   on or feeds the collective, not compute. As compute, a rank whose comm hook ran late read
   as a compute straggler in backward.
6. Anything else: the bare function name with return type, template arguments, argument list,
   addresses and launch-configuration suffixes stripped.

Rare classes are not handled here: :class:`~stepwatch.exporters.kernels.KernelSummariser`
folds everything outside the top K into class ``other``.
"""

from __future__ import annotations

import functools
import re
from typing import Final, NamedTuple

COMPUTE: Final = "compute"
COMMUNICATION: Final = "communication"
MEMORY: Final = "memory"
OTHER: Final = "other"

OTHER_CLASS: Final = "other"
"""The class every folded (rare) kernel is reported under."""

_MAX_CLASS_CHARS: Final = 64


class KernelClass(NamedTuple):
    """A normalised kernel name and its category (``compute``, ``communication``, ``memory``,
    ``other``)."""

    name: str
    category: str


# NCCL device kernels: ncclKernel_<Op>_<ALGO>_<PROTO>_<RedOp>_<type> (NCCL < 2.19) and
# ncclDevKernel_<Op>_<RedOp>_<type>_<ALGO>_<PROTO> / ncclDevKernel_Generic (NCCL >= 2.19).
_NCCL_KERNEL = re.compile(r"^(?:void\s+)?nccl(?:Dev)?Kernel_([A-Za-z]+)")
# CPU-side collectives as torch.profiler / Kineto name them.
_CPU_COLLECTIVE = re.compile(
    r"^(nccl|gloo|mpi|ucc|c10d|record_param_comms)(?::+|$)_*([A-Za-z_]*)", re.IGNORECASE
)
_NCCL_OPS: Final = {
    "allreduce": "allreduce",
    "all_reduce": "allreduce",
    "allgather": "allgather",
    "all_gather": "allgather",
    "all_gather_base": "allgather",
    "allgather_base": "allgather",
    "allgather_into_tensor_coalesced": "allgather",
    "reducescatter": "reducescatter",
    "reduce_scatter": "reducescatter",
    "reduce_scatter_base": "reducescatter",
    "reduce_scatter_tensor_coalesced": "reducescatter",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "sendrecv": "sendrecv",
    "send": "send",
    "recv": "recv",
    "alltoall": "alltoall",
    "all_to_all": "alltoall",
    "alltoall_base": "alltoall",
    "barrier": "barrier",
    "generic": "generic",
    "gather": "gather",
    "scatter": "scatter",
    "allreduce_coalesced": "allreduce",
}
_MEMCPY = re.compile(r"^memcpy\s+(htod|dtoh|dtod|htoh|ptop|dtoa|atod|atoh|htoa)", re.IGNORECASE)

# ATen ops that belong to a library family, so CPU and GPU sources agree on e.g. ``gemm``.
_ATEN_FAMILIES: Final = {
    **dict.fromkeys(
        ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot", "addbmm"),
        ("gemm", COMPUTE),
    ),
    **dict.fromkeys(
        (
            "convolution",
            "_convolution",
            "conv1d",
            "conv2d",
            "conv3d",
            "mkldnn_convolution",
            "cudnn_convolution",
            "convolution_backward",
            "conv_transpose2d",
        ),
        ("conv", COMPUTE),
    ),
    **dict.fromkeys(
        ("softmax", "_softmax", "log_softmax", "_log_softmax", "_softmax_backward_data"),
        ("softmax", COMPUTE),
    ),
    **dict.fromkeys(
        (
            "layer_norm",
            "native_layer_norm",
            "native_layer_norm_backward",
            "batch_norm",
            "native_batch_norm",
            "group_norm",
            "native_group_norm",
            "rms_norm",
        ),
        ("norm", COMPUTE),
    ),
    **dict.fromkeys(
        ("copy", "to", "_to_copy", "clone", "contiguous", "_copy_from"), ("copy", MEMORY)
    ),
    **dict.fromkeys(("fill", "zero", "zeros", "ones", "full"), ("fill", MEMORY)),
    **dict.fromkeys(("cat", "stack"), ("cat", MEMORY)),
    **dict.fromkeys(
        ("scaled_dot_product_attention", "_scaled_dot_product_flash_attention"),
        ("attention", COMPUTE),
    ),
}

# Library-family patterns on GPU kernel names (lower-cased), first match wins. Order matters:
# convolutions before gemm (cuDNN implicit-gemm convs contain "gemm"), fbgemm (embedding
# library) before gemm, cuBLAS split-K reduce before the generic reduce.
_ACCUMULATE_GRAD: Final = "torch::autograd::AccumulateGrad"
_FAMILIES: Final = (
    (re.compile(r"fbgemm|embedding|_embs"), "embedding", COMPUTE),
    (re.compile(r"conv(?!ex)|fprop|dgrad|wgrad|winograd|implicit_gemm"), "conv", COMPUTE),
    (re.compile(r"flash|fmha|attention|sdpa"), "attention", COMPUTE),
    (re.compile(r"gemm|gemv|cublas|cutlass|splitkreduce|sgemm|hgemm|dot_kernel"), "gemm", COMPUTE),
    (re.compile(r"softmax"), "softmax", COMPUTE),
    (re.compile(r"norm|rowwisemoments|gammabeta|bn_fw|bn_bw|welford"), "norm", COMPUTE),
    (re.compile(r"catarray|cat_kernel"), "cat", MEMORY),
    (re.compile(r"direct_copy|copy_kernel|copy_device"), "copy", MEMORY),
    (re.compile(r"fillfunctor|fill_kernel"), "fill", MEMORY),
    (re.compile(r"reduce"), "reduce", COMPUTE),
    (re.compile(r"scan"), "scan", COMPUTE),
    (re.compile(r"sort"), "sort", COMPUTE),
    (re.compile(r"index|gather|scatter"), "index", COMPUTE),
    (
        re.compile(r"elementwise|pointwise|foreach|multi_tensor|unrolled|vectorized"),
        "elementwise",
        COMPUTE,
    ),
)

_HEX = re.compile(r"0x[0-9a-fA-F]+")
_IDENTIFIER = re.compile(r"[A-Za-z_]")
_LAUNCH_SUFFIX = re.compile(r"(?:_\d+(?:x\d+)+\w*|_sm\d+|_\d+)$")


def _strip_brackets(text: str, open_char: str, close_char: str) -> str:
    """Remove every balanced ``open … close`` group (nested ones included)."""
    out: list[str] = []
    depth = 0
    for char in text:
        if char == open_char:
            depth += 1
        elif char == close_char and depth:
            depth -= 1
        elif not depth:
            out.append(char)
    return "".join(out)


def _bare_function_name(raw: str) -> str:
    """``void ns::f<T>(args) [clone .kd]`` → ``ns::f`` (also strips addresses and suffixes)."""
    name = _HEX.sub("", raw).replace("(anonymous namespace)::", "")
    name = _strip_brackets(name, "(", ")")
    name = _strip_brackets(name, "<", ">")
    name = _strip_brackets(name, "[", "]")
    parts = [part for part in name.split() if _IDENTIFIER.search(part)]
    # The function name is the last identifier-like token ("void", "static" go).
    name = parts[-1] if parts else ""
    name = name.strip(":")
    previous = None
    while previous != name:
        previous = name
        name = _LAUNCH_SUFFIX.sub("", name)
    return name[:_MAX_CLASS_CHARS] or "unknown"


def _collective(op: str, backend: str) -> KernelClass:
    key = op.strip("_").lower()
    normalised = _NCCL_OPS.get(key)
    if normalised is None:
        normalised = re.sub(r"[^a-z0-9]+", "", key) or "generic"
    return KernelClass(f"{backend}_{normalised}", COMMUNICATION)


@functools.lru_cache(maxsize=8192)
def classify_kernel(raw_name: str) -> KernelClass:
    """Normalise a raw kernel / op name into a bounded class and a category.

    Args:
        raw_name: the name as CUPTI, torch.profiler or a Kineto trace reports it.

    Returns:
        The :class:`KernelClass`; cached, so repeated names cost a dict lookup.

    Example:
        >>> classify_kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL")
        KernelClass(name='nccl_allreduce', category='communication')
        >>> classify_kernel("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, ncclWork*)")
        KernelClass(name='nccl_allreduce', category='communication')
        >>> classify_kernel("volta_sgemm_128x32_nt")
        KernelClass(name='gemm', category='compute')
        >>> classify_kernel("Memcpy HtoD (Pinned -> Device)")
        KernelClass(name='memcpy_htod', category='memory')
        >>> classify_kernel("aten::add_")
        KernelClass(name='add', category='compute')
    """
    name = raw_name.strip()
    nccl = _NCCL_KERNEL.match(name)
    if nccl is not None:
        return _collective(nccl.group(1), "nccl")
    lowered = name.lower()
    memcpy = _MEMCPY.match(name)
    if memcpy is not None:
        return KernelClass(f"memcpy_{memcpy.group(1).lower()}", MEMORY)
    if lowered.startswith("memset"):
        return KernelClass("memset", MEMORY)
    collective = _CPU_COLLECTIVE.match(name)
    if collective is not None:
        backend = collective.group(1).lower()
        if backend == "record_param_comms":
            return KernelClass("record_param_comms", COMMUNICATION)
        return _collective(collective.group(2), backend)
    if lowered.startswith("aten::"):
        op = name[len("aten::") :].rstrip("_").lower()
        family = _ATEN_FAMILIES.get(op)
        if family is not None:
            return KernelClass(*family)
        return KernelClass(op[:_MAX_CLASS_CHARS] or "unknown", COMPUTE)
    if name.startswith(_ACCUMULATE_GRAD):
        return KernelClass(_ACCUMULATE_GRAD, OTHER)
    for pattern, family_name, category in _FAMILIES:
        if pattern.search(lowered):
            return KernelClass(family_name, category)
    if lowered.startswith(("cuda", "cu")) and "::" not in name and "(" not in name:
        # CUDA runtime / driver calls (cudaLaunchKernel) are host-side overhead, not kernels.
        return KernelClass(_bare_function_name(name), OTHER)
    return KernelClass(_bare_function_name(name), COMPUTE)
