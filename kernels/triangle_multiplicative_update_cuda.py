"""triangle multiplicative update with CUDA kernels (GPU only): the same model body as triangle_multiplicative_update_cpp.py
(kernels/_triangle_body.py) with the kernels of kernels/cuda/structure_ops.cu."""
import os
import runpy

_here = os.path.dirname(os.path.abspath(__file__))
_k = runpy.run_path(os.path.join(_here, "cuda_ops.py"))
_body = runpy.run_path(os.path.join(_here, "_triangle_body.py"), init_globals={"ops": _k["load"]()})
ModelNew = _body["ModelNew"]
