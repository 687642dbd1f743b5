"""Invariant point attention with C++ kernels: frame transform of the query/key/value points,
fused logits (scalar q.k + pair bias + weighted point distance), softmax and aggregation in
torch, and the inverse frame transform of the attended points.  BUG_* select broken variants."""
import os
import runpy

_here = os.path.dirname(os.path.abspath(__file__))
_ops = runpy.run_path(os.path.join(_here, "cpu_ops.py"))["load"]()
_body = runpy.run_path(os.path.join(_here, "_ipa_body.py"), init_globals={"ops": _ops})
ModelNew = _body["ModelNew"]
