"""Captured values are what each op produced, though capture copies an op's output only when
something is about to write into its memory (or something else still holds it when capture ends)."""
import importlib
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

C = importlib.import_module("diffkit.capture")  # the module (the package exports the function by that name)
V = importlib.import_module("diffkit.capture_values")  # where capture copies values


def _capture(model, *inputs):
    with torch.no_grad():
        cap = C.capture(model, inputs=inputs)
        with cap as trace:
            model(*inputs)
    return trace


def _value(trace, op_suffix):
    return next(r for r in trace.records if r.op.endswith(op_suffix)).value


class InplaceAct(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        h = x * 2.0
        if self.how == "module":
            h = self.act(h)
        elif self.how == "kw":
            h = F.relu(h, inplace=True)
        elif self.how == "positional":
            h = F.relu(h, True)
        else:
            h.relu_()
        return h + 1.0


def test_in_place_activations_do_not_change_what_was_recorded():
    x = torch.randn(4, 8)
    for how in ("module", "kw", "positional", "method"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "overwritten ... not compared" warning either
            trace = _capture(InplaceAct(how), x)
        torch.testing.assert_close(_value(trace, "mul"), x * 2.0, msg=how)


def test_a_value_the_user_keeps_and_changes_later_is_the_recorded_one():
    kept = []

    class Keep(nn.Module):
        def forward(self, x):
            y = x * 3.0
            kept.append(y)
            return y - 1.0

    x = torch.randn(5)
    trace = _capture(Keep(), x)
    kept[0].add_(100.0)  # after the capture: the record must not see it
    torch.testing.assert_close(_value(trace, "mul"), x * 3.0)


def test_a_buffer_the_model_reuses_across_forwards_keeps_each_forward_s_value():
    class Reuse(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(6))

        def forward(self, x):
            torch.mul(x, 2.0, out=self.buf)
            return self.buf + 0.0

    m = Reuse()
    a, b = torch.ones(6), torch.full((6,), 5.0)
    first = _capture(m, a)
    _capture(m, b)
    assert all(float(v) == 2.0 for v in first.records[-1].value)  # the output record of the first forward


def test_intermediates_the_forward_drops_are_not_copied(monkeypatch):
    copies = []
    real = V._snapshot

    def counting(t):
        copies.append(t.shape)
        return real(t)

    monkeypatch.setattr(V, "_snapshot", counting)

    class Chain(nn.Module):
        def forward(self, x):
            for _ in range(20):
                x = torch.tanh(x * 1.5)
            return x

    trace = _capture(Chain(), torch.randn(3, 3))
    # the input's record is copied when recorded; the 40 op records are not (nothing else holds them)
    assert len(copies) <= 2, copies
    assert len([r for r in trace.records if r.value is not None]) >= 40


def test_hooks_are_removed_even_when_keeping_values_fails(monkeypatch):
    def boom(self):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(C._State, "seal", boom)
    before = (len(torch.nn.modules.module._global_forward_hooks),
              len(torch.nn.modules.module._global_forward_pre_hooks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = _capture(nn.Linear(3, 3), torch.randn(2, 3))
    after = (len(torch.nn.modules.module._global_forward_hooks),
             len(torch.nn.modules.module._global_forward_pre_hooks))
    assert after == before
    # what could not be kept is not compared, rather than compared against memory that may change
    assert trace.output is not None and trace.output.value is None
