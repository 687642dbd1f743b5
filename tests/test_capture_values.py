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


class WritesItsInput(nn.Module):
    """Doubles its input in place (as a kernel handed the input's pointer may), then adds one."""

    def forward(self, x):
        x.mul_(2.0)
        return x + 1.0


def test_an_input_is_copied_once_and_the_forward_s_tensors_are_let_go_when_the_capture_ends():
    """The input record's value is the trace's copy of the input (one copy, not two) and holds the input as it
    came, even where the forward wrote into it; once the capture has ended it keeps neither the forward's tensor
    nor a copy of its own (a streaming store keeps its capture for the whole diff: a 2 GB input would stay on the
    card three times over)."""
    import gc
    import weakref

    model = WritesItsInput()
    given = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    x = given.clone()
    with torch.no_grad():
        cap = C.capture(model, inputs=(x,))
        with cap as trace:
            model(x)
    rec = next(r for r in trace.records if r.kind == "input")
    assert trace.inputs[0] is rec.value and rec.value is not x
    assert torch.equal(rec.value, given)  # as it came: the forward's write is not in it
    assert list(trace.inputs_left) == [rec.name] and torch.equal(trace.inputs_left[rec.name], given * 2)
    assert cap._given == []

    plain = nn.Linear(3, 2)
    y = given.clone()
    with torch.no_grad():
        cap = C.capture(plain, inputs=(y,))
        with cap as trace:
            plain(y)
    gone = weakref.ref(y)
    del y
    gc.collect()
    assert gone() is None, "the capture (kept by its caller) still holds the forward's input"
    assert len(trace.inputs) == 1 and torch.equal(trace.inputs[0], given) and not trace.inputs_left


def test_a_sink_that_owns_the_values_gets_the_input_and_the_trace_keeps_no_second_copy(monkeypatch):
    """Streaming: the store keeps the capture's own copy of the input as the input record's value (not a copy of
    it); the trace keeps no copy, and the capture none once it has ended; whether the forward wrote into its
    input is still found."""
    from diffkit.tiers import Budget, TieredStore

    made = []

    def spy(t):
        made.append(V.own_copy(t))
        return made[-1]

    monkeypatch.setattr(C, "own_copy", spy)
    store = TieredStore(Budget(1 << 30), Budget(0))
    model = WritesItsInput()
    given = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    x = given.clone()
    with torch.no_grad():
        cap = C.capture(model, inputs=(x,), sink=store)
        store.bind_capture(cap)
        with cap as trace:
            model(x)
    rec = next(r for r in trace.records if r.kind == "input")
    assert trace.inputs == [] and cap._given == []
    kept = store.get(rec.index, None)
    assert torch.equal(kept, given) and len(made) == 1 and V.is_own_copy(made[0])
    assert kept.data_ptr() == made[0].data_ptr() != x.data_ptr()  # the capture's copy itself, not one more
    assert list(trace.inputs_left) == [rec.name]
