"""Build (once, cached by ninja) and return the CPU C++ extension the candidates in kernels/ call.

Candidate files are executed as source, so they load this helper by path:
    ops = runpy.run_path(os.path.join(os.path.dirname(__file__), "cpu_ops.py"))["load"]()
"""
import os

from torch.utils.cpp_extension import load_inline

FUNCTIONS = ["linear", "layernorm", "layernorm_linear", "linear_gelu", "softmax_lastdim", "attention_scores",
             "attention", "gated_linear", "triangle_outgoing", "frame_apply", "ipa_logits", "scale_into"]

# bug flags, mirroring the enum in cpu/ops.cpp
UNBIASED_VAR, TRANSPOSED_W, SKIP_TAIL, NO_SCALE, WRONG_AXIS = 1, 2, 4, 8, 16
TANH_GELU, SWAP_IJ, BIAS_LAYOUT, NO_MAX_SUB, TAIL_ROWS = 32, 64, 128, 256, 512

_cache = {}


def load(verbose=False):
    if "ops" not in _cache:
        here = os.path.dirname(os.path.abspath(__file__))
        with open(os.path.join(here, "cpu", "ops.cpp"), encoding="utf-8") as fh:
            source = fh.read()
        _cache["ops"] = load_inline(name="diffkit_cpu_ops", cpp_sources=[source], functions=FUNCTIONS,
                                    extra_cflags=["-O2"], verbose=verbose)
    return _cache["ops"]
