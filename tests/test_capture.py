"""Capture: order, names, extension calls, snapshots, repeated modules, taps, no duplicates."""
import math
import sys
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import diffkit
from diffkit.load import exec_file

from conftest import KERNELS, REFS


def _capture(model, *inputs):
    with torch.no_grad(), diffkit.capture(model, inputs=inputs) as trace:
        model(*inputs)
    return trace


class Attn(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.d = d

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
        attn = F.softmax(scores, dim=-1)
        ctx = diffkit.tap("context", attn @ v)
        return self.out(ctx)


def test_records_in_order_with_source_names():
    torch.manual_seed(0)
    trace = _capture(Attn(), torch.randn(2, 5, 8))
    names = trace.names()
    assert names[0] == "input[0]"
    # q, k, v by position; the whole right-hand side gets the assigned name; sub-expressions their text
    for expected in ["qkv", "forward:q", "forward:k", "forward:v", "forward:k.transpose(-1, -2)",
                     "forward:q @ k.transpose(-1, -2)", "forward:scores", "forward:attn", "tap:context", "out"]:
        assert expected in names, (expected, names)
    order = [names.index(n) for n in ["qkv", "forward:q", "forward:scores", "forward:attn", "tap:context", "out"]]
    assert order == sorted(order)
    assert [r.index for r in trace] == list(range(len(trace)))
    scores = trace["forward:scores"]
    assert scores.op == "Tensor.div" and scores.shape == (2, 5, 5) and scores.line > 0
    assert scores.function == "forward" and scores.file.endswith("test_capture.py")
    # the values are what the model computed
    q, k = trace["forward:q"].value, trace["forward:k"].value
    torch.testing.assert_close(scores.value, (q @ k.transpose(-1, -2)) / math.sqrt(8))


def test_tap_names_the_tensor_once_and_is_free_outside_capture():
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    assert diffkit.tap("free", x) is x
    trace = _capture(Attn(4), torch.randn(1, 3, 4))
    rec = trace["tap:context"]
    assert rec.kind == "tap"
    # the matmul that produced it is the same tensor: one record, known by both names
    assert "forward:attn @ v" in rec.aliases
    assert sum(1 for r in trace if r.name == "tap:context" or "tap:context" in r.aliases) == 1


def test_nothing_recorded_twice():
    torch.manual_seed(0)
    trace = _capture(Attn(), torch.randn(2, 5, 8))
    assert len(set(trace.names())) == len(trace)
    # a module's output that is also the model's output is one record with two names
    out = trace.output
    # (named as the user wrote it: the submodule's name, `output` an alias)
    assert out.name == "out" and "output" in out.aliases
    # the internals of nn.Linear (F.linear) are not recorded next to the module record
    assert not any(r.op == "F.linear" for r in trace)


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Linear(4, 4)

    def forward(self, x):
        x = self.block(x)
        x = self.block(x)
        return x.relu()


def test_module_called_twice_is_counted():
    trace = _capture(Shared(), torch.randn(2, 4))
    assert "block" in trace.names() and "block#2" in trace.names()
    first, second = trace["block"], trace["block#2"]
    assert first.index < second.index


class InPlace(nn.Module):
    def forward(self, x):
        y = x * 2
        y += 1
        y[0] = 0.0
        return y


def test_snapshots_do_not_change_with_later_in_place_writes():
    x = torch.ones(3, 2)
    trace = _capture(InPlace(), x)
    first = trace["forward:y"]
    torch.testing.assert_close(first.value, torch.full((3, 2), 2.0))
    assert "forward:y#2" in trace.names()
    torch.testing.assert_close(trace["forward:y#2"].value, torch.full((3, 2), 3.0))
    written = trace["forward:y#3"]  # the write is also the output: one record, two names
    assert written is trace.output and written.op == "Tensor.__setitem__" and written.value[0].abs().sum() == 0 and written.value[1, 0] == 3.0


def test_extension_calls_are_recorded_with_their_outputs(ops):
    mod = exec_file(os.path.join(KERNELS, "transformer_block_cpp.py"), "candidate")
    ref = exec_file(os.path.join(REFS, "transformer_block.py"), "reference")
    torch.manual_seed(42)
    model = mod.ModelNew(*ref.get_init_inputs()).eval()
    x = ref.get_inputs()[0]
    trace = _capture(model, x)
    ext = [r for r in trace if r.kind == "ext"]
    assert [r.op.split(".")[-1] for r in ext][:4] == ["layernorm", "linear", "attention_scores", "softmax_lastdim"]
    scores = trace["forward:scores"]
    assert scores.kind == "ext" and scores.shape == (2, 4, 12, 12)
    q, k = trace["forward:q"].value, trace["forward:k"].value
    torch.testing.assert_close(scores.value, q @ k.transpose(-1, -2) / math.sqrt(8), atol=1e-5, rtol=1e-5)
    # the wrapper is gone after the capture
    assert not hasattr(mod.ops.linear, "__wrapped__")


_bound_scale_into = None  # set like `from ext import scale_into` would, before capture starts


class Writer(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        _bound_scale_into(out, x, 3.0)
        return out + 1


def test_extension_built_before_capture_and_bound_by_name(ops):
    global _bound_scale_into
    _bound_scale_into = ops.scale_into
    trace = _capture(Writer(), torch.ones(4))
    assert _bound_scale_into is ops.scale_into  # restored after the capture
    written = [r for r in trace if r.kind == "write"]
    assert len(written) == 1 and written[0].op.endswith("scale_into")
    assert written[0].label == "out"
    torch.testing.assert_close(written[0].value, torch.full((4,), 3.0))


def test_all_references_capture_cleanly():
    for name in sorted(os.listdir(REFS)):
        if not name.endswith(".py"):
            continue
        mod = exec_file(os.path.join(REFS, name), "reference")
        torch.manual_seed(42)
        model = mod.Model(*mod.get_init_inputs()).eval()
        inputs = mod.get_inputs()
        trace = _capture(model, *inputs)
        assert trace.error is None and trace.output is not None
        assert not any(r.name.split(":")[-1].startswith("op_") for r in trace)
        with torch.no_grad():
            torch.testing.assert_close(trace.output.value, model(*inputs))


def test_error_mid_forward_keeps_records_and_says_where():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h @ torch.ones(5, 5)

    cap = diffkit.capture(Boom(), inputs=(torch.randn(2, 4),))
    with pytest.raises(RuntimeError):
        with torch.no_grad(), cap as trace:
            Boom.forward(cap.state.model, torch.randn(2, 4))
    assert "lin" in trace.names()
    assert trace.error is not None and trace.error.function == "forward" and trace.error.line > 0


def test_triton_launch_recorded_once_per_launch(monkeypatch):
    """`kernel[grid](...)` is recorded once per user launch (even when an autotuner runs the inner
    kernel several times), as a write into the argument it changed, named from the call site.
    Triton itself needs a GPU; this stands in for its KernelInterface (the real one: tests/test_gpu.py)."""
    import types

    class KernelInterface:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.run(*args, grid=grid, **kwargs)

    class JITFunction(KernelInterface):
        __name__ = "double_kernel"
        runs = 0

        def run(self, out, x, grid=None, BLOCK=1):
            JITFunction.runs += 1
            out.copy_(x * 2)

    class Autotuner(KernelInterface):
        def __init__(self, fn):
            self.fn = fn

        def run(self, *args, grid=None, **kwargs):
            for _ in range(3):  # benchmarking the configs
                self.fn.run(*args, grid=grid, **kwargs)
            return self.fn.run(*args, grid=grid, **kwargs)

    jit = types.ModuleType("triton.runtime.jit")
    jit.KernelInterface = KernelInterface
    monkeypatch.setitem(sys.modules, "triton.runtime.jit", jit)
    kernel = Autotuner(JITFunction())

    class M(torch.nn.Module):
        def forward(self, x):
            y = torch.empty_like(x)
            kernel[(1,)](y, x, BLOCK=16)
            return y + 1

    x, m = torch.randn(4, 5), M()
    with diffkit.capture(m) as trace:
        m(x)
    writes = [r for r in trace.records if r.op.startswith("triton:")]
    assert JITFunction.runs == 4 and len(writes) == 1
    w = writes[0]
    assert w.name == "forward:y" and w.kind == "write" and w.op == "triton:double_kernel"
    assert torch.equal(w.value, x * 2)
    assert not any(r.op.endswith("empty_like") for r in trace.records)  # an allocation is not a stage
    assert "__getitem__" in vars(KernelInterface) and not hasattr(KernelInterface.__getitem__, "__wrapped__")


def test_tensors_in_a_calls_arguments_are_found_at_the_positions_pytree_gives():
    """The direct walk over plain tuples, lists and dicts (every op's arguments) gives what pytree's
    key paths give, and hands named tuples and other containers to pytree."""
    import collections

    import torch.utils._pytree as pytree

    from diffkit.capture import _tensors, path_key

    def by_pytree(obj):
        flat, _ = pytree.tree_flatten_with_path(obj)
        return [(tuple(path_key(k) for k in path), id(v)) for path, v in flat if isinstance(v, torch.Tensor)]

    x, y = torch.ones(2), torch.zeros(3)
    pair = collections.namedtuple("pair", "a b")
    for obj in [(x, [2, 3], 1), {"b": x, "a": [y, 1.0, None]}, [x, (y, (x,))], (x, pair(x, y)),
                (x, slice(1, 2), Ellipsis, torch.float32, torch.Size([2, 3])), ({"z": y, "a": x},), (), [[], {}],
                (x, torch.nn.Parameter(torch.ones(1)))]:
        assert [(p, id(v)) for p, v in _tensors(obj)] == by_pytree(obj), obj


EDITED_REF = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        hidden = torch.sigmoid(self.fc(x))
        return hidden * 3


def get_inputs():
    return [torch.randn(5, 6)]


def get_init_inputs():
    return []
'''

EDITED_BEFORE = '''
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, inp):
        act = self.fc(inp).sigmoid()
        return act.mul(3)
'''

# the same file edited (a notebook's next cell): lines moved, the variable renamed to the reference's name
EDITED_AFTER = '''
import torch
from torch import nn


def _squash(t):
    return torch.sigmoid(t)


class ModelNew(nn.Module):
    """edited: the activation through a helper"""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, inp):
        # one more line above the stage
        hidden = _squash(self.fc(inp))
        return 3 * hidden
'''


def test_a_file_edited_between_two_diffs_in_one_process_is_named_from_its_new_text(tmp_path):
    """Each stage's name quotes the source it was made at: after the file is edited (lines moved, a helper
    added), the second diff's names quote the new text, not whatever the old file held at those lines."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(EDITED_REF)

    def quoted(result, source):
        """The stages' candidate names, each checked to quote its own line of `source`."""
        lines = source.splitlines()
        rows = [(s.cand_name, s.cand.line) for s in result.stages if s.cand is not None and ":" in s.cand_name]
        assert rows and all(0 < at <= len(lines) and name.split(":", 1)[1].rstrip("…") in lines[at - 1]
                            for name, at in rows), (rows, source)
        return [s.cand_name for s in result.stages if s.cand is not None]

    cand.write_text(EDITED_BEFORE)
    first = diffkit.diff_files(str(ref), str(cand))
    assert any("act" in n for n in quoted(first, EDITED_BEFORE))
    cand.write_text(EDITED_AFTER)
    second = diffkit.diff_files(str(ref), str(cand))
    assert not any("act" in n for n in quoted(second, EDITED_AFTER))
    assert first.verdict == second.verdict == "match"


def test_cpp_extension_is_wrapped_when_imported_and_not_imported_for_a_model_without_one(tmp_path):
    """Loading a model installs the extension hook without importing torch.utils.cpp_extension (and setuptools
    with it); a model that imports it later (at its file's import, or inside forward) gets its importer wrapped,
    so extensions it loads are registered -- a lookup before the import (`importlib.util.find_spec`) included.
    Run in fresh interpreters: this one may have imported both."""
    import subprocess

    plain = tmp_path / "plain.py"
    plain.write_text("import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n        return x * 2\n"
                     "def get_inputs():\n    return [torch.ones(3)]\ndef get_init_inputs():\n    return []\n")
    uses = tmp_path / "uses.py"
    uses.write_text(plain.read_text().replace("import torch\n", "import torch\n"
                                              "from torch.utils.cpp_extension import load_inline\n"))
    probe = (
        "import sys, diffkit\n"
        "from diffkit.load import exec_file\n"
        "exec_file(sys.argv[1], 'cand')\n"
        "ce = sys.modules.get('torch.utils.cpp_extension')\n"
        "print('imported' if ce is not None else 'not imported', 'setuptools' in sys.modules)\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('torch.utils.cpp_extension') is not None  # a lookup, as libraries make\n"
        "import torch.utils.cpp_extension as ce\n"
        "print('wrapped' if getattr(ce._import_module_from_library, '_diffkit', False) else 'bare')\n")
    for path, first in ((plain, "not imported False"), (uses, "imported")):
        p = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, timeout=120,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert p.returncode == 0, p.stderr[-2000:]
        lines = p.stdout.split("\n")
        assert lines[0].startswith(first) and lines[1] == "wrapped", p.stdout
