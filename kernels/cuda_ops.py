"""Build (once, cached by ninja) and return the CUDA extension the IPA and triangle CUDA candidates
call: kernels/cuda/structure_ops.cu, the same functions and signatures as the CPU build
(cpu_ops.py), so the candidate bodies (_ipa_body.py, _triangle_body.py) serve both.

    ops = runpy.run_path(os.path.join(os.path.dirname(__file__), "cuda_ops.py"))["load"]()
"""
import os

from torch.utils.cpp_extension import load_inline

DECLARATIONS = """
torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b, int64_t bug, int64_t tile);
torch::Tensor gated_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor bp, torch::Tensor wg, torch::Tensor bg,
                           int64_t bug, int64_t tile);
torch::Tensor layernorm(torch::Tensor x, torch::Tensor g, torch::Tensor b, double eps, int64_t bug);
torch::Tensor triangle_outgoing(torch::Tensor a, torch::Tensor bb, int64_t bug);
torch::Tensor frame_apply(torch::Tensor R, torch::Tensor t, torch::Tensor p, bool inverse, int64_t bug);
torch::Tensor ipa_logits(torch::Tensor q, torch::Tensor k, torch::Tensor qp, torch::Tensor kp, torch::Tensor bias,
                         torch::Tensor gamma, double w_s, double w_b, double w_p, int64_t bug);
"""
FUNCTIONS = ["linear", "gated_linear", "layernorm", "triangle_outgoing", "frame_apply", "ipa_logits"]

# bug flags, mirroring the enum in cuda/structure_ops.cu
SKIP_TAIL, BIAS_LAYOUT, RACE, HALF_ACC = 4, 128, 1024, 2048

_cache = {}


def load(verbose=False):
    if "ops" not in _cache:
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "cuda", "structure_ops.cu"), encoding="utf-8") as fh:
            source = fh.read()
        _cache["ops"] = load_inline(name="diffkit_structure_cuda", cpp_sources=[DECLARATIONS], cuda_sources=[source],
                                    functions=FUNCTIONS, extra_cuda_cflags=["-O3", "-gencode=arch=compute_90,code=sm_90"],
                                    verbose=verbose)
    return _cache["ops"]
