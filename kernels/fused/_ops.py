"""Build (once, cached by ninja) and return the fused extensions the candidates in kernels/fused/ call.

Candidate files are executed by path, so they load this helper by path too:

    _ops = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ops.py"))
    ext = _ops["load"]()             # CPU: fused_ops.cpp, extension diffkit_fused_ops
    ext = _ops["load_cuda"]()        # GPU: fused_cuda.cu, extension diffkit_fused_cuda

Every function of either extension computes one reference model's whole forward in a single call;
its last argument `bug` picks a planted mistake (0 = correct).  The codes below mirror the enums in
fused_ops.cpp / fused_cuda.cu (README.md says which candidate plants which).
"""
import os

from torch.utils.cpp_extension import load as _load

HERE = os.path.dirname(os.path.abspath(__file__))

AXIAL = {"ok": 0, "out_no_bias": 1, "out_tail": 2, "qkv_read_as_in_out": 3, "scores_model_width": 4,
         "softmax_query_axis": 5, "col_norm_negated": 6, "out_tf32": 7}  # out_tf32: CUDA only
TRANSFORMER_BLOCK = {"ok": 0, "ln1_unbiased": 1, "qkv_bf16": 2, "no_scale": 3, "neg_scale": 4,
                     "softmax_query_axis": 5, "logits_ji": 6, "proj_bias_twice": 7, "proj_read_as_in_out": 8,
                     "fc1_no_bias": 9, "tanh_gelu": 10, "tiled_tail_rows": 11,
                     "softmax_rows_of_5_floor": 12}  # 12: CUDA only
TRIANGLE = {"ok": 0, "a_tail": 1, "a_tail_rows": 2, "swap_ij": 3, "bf16_sum": 4, "affine_bias_twice": 5}
IPA = {"ok": 0, "rot_transposed": 1, "bias_layout": 2, "half_logits": 3}  # half_logits: CUDA only
GEMM_BN = {"ok": 0, "running_stats": 1}
TEMPERED = {"ok": 0, "no_max": 1, "max_first": 2}
SWIGLU = {"ok": 0, "rms_sum": 1, "fast_silu": 2, "down_tail": 3}  # down_tail: CUDA only
GELU = {"ok": 0, "flush_tail": 1}


def load(verbose=False):
    """The CPU extension (fused_ops.cpp), built with -O2 on first use."""
    return _load(name="diffkit_fused_ops", sources=[os.path.join(HERE, "fused_ops.cpp")], extra_cflags=["-O2"],
                 verbose=verbose)


def load_cuda(verbose=False):
    """The CUDA extension (fused_cuda.cu), built for sm_90 (H100/H200) on first use."""
    return _load(name="diffkit_fused_cuda", sources=[os.path.join(HERE, "fused_cuda.cu")], extra_cflags=["-O2"],
                 extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"], verbose=verbose)
