"""Triangle multiplicative update (outgoing) with C++ kernels: fused LayerNorm, fused gated
projections for a and b, the triangle contraction, and the output LayerNorm/projection/gate."""
import os
import runpy

_here = os.path.dirname(os.path.abspath(__file__))
_ops = runpy.run_path(os.path.join(_here, "cpu_ops.py"))["load"]()
_body = runpy.run_path(os.path.join(_here, "_triangle_body.py"), init_globals={"ops": _ops})
ModelNew = _body["ModelNew"]
