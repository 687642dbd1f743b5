"""Streaming two-pass diff: same answer as the in-memory diff, in bounded memory."""
import json
import os
import subprocess
import sys

import pytest
import torch

import diffkit
from diffkit.stream import Budget, TieredStore, name_filter, parse_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = os.path.join(ROOT, "references", "deep_transformer.py")
CAND = os.path.join(ROOT, "kernels", "deep_transformer_fused.py")


def _pair(monkeypatch, bug, **size):
    env = {"DIFFKIT_DEPTH": "6", "DIFFKIT_BATCH": "2", "DIFFKIT_SEQ": "32", "DIFFKIT_DIM": "64",
           "DIFFKIT_BUG_BLOCK": str(bug), **{k: str(v) for k, v in size.items()}}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return diffkit.load_pair(REF, CAND)


def _key(r):
    fd, rc = r.first_divergence, r.root_cause
    return (r.verdict, fd and fd.ref_name, fd and fd.cand_name, rc and rc.ref_name,
            fd.diagnosis[0].kind if fd is not None and fd.diagnosis else None)


@pytest.mark.parametrize("bug,size", [(3, {}), (-1, {}),
                                      # a size whose freed values' memory comes back to the next block's calls
                                      (-1, dict(DIFFKIT_SEQ=128, DIFFKIT_DIM=128))])
def test_streaming_same_answer_as_in_memory(monkeypatch, bug, size):
    pair = _pair(monkeypatch, bug, **size)
    full = diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs)
    budget = 64 << 10  # far below the intermediates: most reference values go to disk
    s = diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, max_memory=budget)
    assert _key(s) == _key(full)
    if bug >= 0:
        assert s.first_divergence.ref_name == f"blocks.{bug}.fc2"
        assert s.first_divergence.diagnosis[0].kind == "missing_bias"
        # the stages the report shows carry values
        assert s.first_divergence.cand_value is not None and s.first_divergence.ref_value is not None
    assert s.meta["mode"] == "streaming"
    assert s.meta["peak_device_bytes"] <= budget
    assert s.meta["spilled_bytes"] > budget
    # every stage measured in memory is measured when streaming, with the same numbers
    fm = {(x.ref_name, x.cand_name): x.stats for x in full.stages if x.stats}
    sm = {(x.ref_name, x.cand_name): x.stats for x in s.stages if x.stats}
    assert fm.keys() == sm.keys()
    for k in fm:
        assert fm[k].mismatches == sm[k].mismatches and fm[k].max_abs == pytest.approx(sm[k].max_abs, rel=1e-9, abs=1e-12)


def test_stop_at_first_and_only(monkeypatch):
    pair = _pair(monkeypatch, 2)
    r = diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, stop_at_first=True)
    assert r.verdict == "diverged" and r.first_divergence.ref_name == "blocks.2.fc2"
    assert r.meta["stopped"] and any("stop-at-first" in w for w in r.warnings)
    # the candidate's forward ended there: no candidate record of a later block
    assert not any(x.cand is not None and x.cand.name.startswith(("blocks.3", "blocks.4", "blocks.5"))
                   for x in r.stages)
    o = diffkit.compare(pair.ref, pair.cand, pair.ref_inputs, cand_inputs=pair.cand_inputs, only="blocks.2.*")
    names = [x.ref_name for x in o.stages if x.ref is not None]
    assert names and all(n.startswith(("blocks.2.", "output", "input")) for n in names)
    assert o.first_divergence.ref_name == "blocks.2.fc2" and o.verdict == "diverged"


def test_tiered_store_tiers_and_drop(tmp_path):
    store = TieredStore(Budget(1000), spill_dir=str(tmp_path))
    a, b = torch.randn(100), torch.randn(1000)  # 400 B fits, 4000 B spills
    a0 = a.clone()
    store.put(0, a)
    store.put(1, b)
    assert store.slots[0].tier == "device" and store.slots[1].tier == "disk"
    a.add_(1)  # a later in-place write does not change what was kept
    assert torch.equal(store.get(0), a0) and torch.equal(store.get(1), b)
    store.drop(0)
    assert store.device_budget.used == 0
    store.clear()
    assert not os.listdir(tmp_path)


def test_parse_size_and_filter():
    assert parse_size("512M") == 512 << 20 and parse_size("1.5G") == int(1.5 * (1 << 30)) and parse_size("4096") == 4096
    with pytest.raises(ValueError):
        parse_size("lots")
    keep = name_filter("blocks.1.*,tap:*")
    assert keep("blocks.1.fc2") and keep("tap:x") and keep("output") and keep("input[0]") and not keep("blocks.2.fc2")


def _peak(mode, budget="32M"):
    env = dict(os.environ, DIFFKIT_DEPTH="12", DIFFKIT_BATCH="2", DIFFKIT_SEQ="256", DIFFKIT_DIM="256",
               DIFFKIT_BUG_BLOCK="7", MALLOC_MMAP_THRESHOLD_="65536")  # freed tensors go back to the OS
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "stream_memory.py"), mode, "--max-memory", budget],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# what the streaming machinery itself may hold besides the budget, whatever the model's size:
# the measure's float64 chunk temporaries, two lazily read values during alignment, bookkeeping
WORKING_SET = 112 << 20


def test_streaming_peak_memory_within_budget():
    budget = 32 << 20
    mem, stream = _peak("memory"), _peak("stream")
    assert stream["intermediates"] > 4 * budget  # the model really does not fit the budget
    # each process's own baseline: its RSS after loading the models and running both forwards once
    extra_stream = stream["peak_rss"] - stream["base_rss"]
    extra_mem = mem["peak_rss"] - mem["base_rss"]
    print(f"\nintermediates {stream['intermediates'] >> 20} MiB, budget {budget >> 20} MiB: peak extra RSS "
          f"in-memory {extra_mem >> 20} MiB, streaming {extra_stream >> 20} MiB")
    assert extra_stream <= budget + WORKING_SET, (mem, stream)
    assert extra_mem > budget + WORKING_SET, (mem, stream)  # the in-memory diff of the same model does not fit
    for k in ("verdict", "first", "first_cand", "root", "kind"):
        assert stream[k] == mem[k]
    assert stream["first"] == "blocks.7.fc2" and stream["kind"] == "missing_bias"


# ----------------------------------------------------------------------------------- lockstep
# Each layer (with NOISE) draws a dropout mask and uniform noise (a training-mode forward): KernelBench
# seeds a trial once, so the candidate draws where the whole reference left the generators.  The
# candidate writes the same computation apart (other names, F.linear), optionally with a bias left out
# or a layer that raises.
_NOISY_REF = """
import torch
FAIL_AT, NOISE = {fail}, {noise}

class Model(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(6))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            if i == FAIL_AT:
                raise RuntimeError(f"layer {{i}} is broken")
            x = torch.nn.functional.dropout(torch.relu(layer(x)), p=0.5, training=NOISE)
            x = x + (torch.rand_like(x) if NOISE else 0.5)
        return x

def get_inputs():
    return [torch.randn(64, 256)]

def get_init_inputs():
    return [256]
"""
_NOISY_NEW = """
import torch
import torch.nn.functional as F
FAIL_AT, SKIP_BIAS_AT, NOISE = {fail}, {skip}, {noise}

class ModelNew(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(6))

    def forward(self, x):
        h = x
        for k, lin in enumerate(self.layers):
            if k == FAIL_AT:
                raise RuntimeError(f"layer {{k}} is broken")
            pre = F.linear(h, lin.weight, None if k == SKIP_BIAS_AT else lin.bias)
            kept = F.dropout(pre.clamp_min(0), p=0.5, training=NOISE)
            h = kept + (torch.rand_like(kept) if NOISE else 0.5)
        return h
"""
_ROW = 64 * 256 * 4  # bytes of one record's value


def _noisy_files(tmp_path, skip=None, ref_fail=None, cand_fail=None, noise=True):
    ref, new = tmp_path / "noisy_ref.py", tmp_path / "noisy_new.py"
    ref.write_text(_NOISY_REF.format(fail=ref_fail, noise=noise))
    new.write_text(_NOISY_NEW.format(fail=cand_fail, skip=skip, noise=noise))
    return str(ref), str(new)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("skip", [None, 3])
@pytest.mark.parametrize("noise", [False, True])
def test_lockstep_runs_both_forwards_once_unless_the_candidate_draws_after_the_reference(tmp_path, skip, device,
                                                                                        noise):
    ref, new = _noisy_files(tmp_path, skip=skip, noise=noise)
    # the reference cannot run far ahead of the candidate
    kw = dict(max_memory=3 * _ROW, health=False, rerun=False, trials=2, device=device)
    full = diffkit.diff_files(ref, new, health=False, rerun=False, trials=2, device=device)
    lock = diffkit.diff_files(ref, new, **kw)
    seq = diffkit.diff_files(ref, new, lockstep=False, **kw)
    if noise:
        # the candidate draws where the whole reference left the generators (KernelBench's order): no
        # side-by-side run gives that, and the diff is made again, the reference first; its dropout draws
        # other masks than the reference's, and KernelBench fails it
        assert "lockstep" not in lock.meta and lock.verdict == "diverged"
    else:
        assert lock.meta["lockstep"]["switches"] > 4 and lock.meta["lockstep"]["evicted"] > 0
    assert "lockstep" not in seq.meta
    assert _key(lock) == _key(seq)
    assert _key(lock)[:3] == _key(full)[:3]  # (a streaming root cause may differ: its replays see a window)
    if not noise and skip is None:
        assert lock.verdict == "match"
        assert all(s.stats.max_abs == 0 for s in lock.stages if s.stats is not None)
    elif not noise:
        fd = lock.first_divergence
        assert fd.ref_name == f"layers.{skip}" and fd.diagnosis[0].kind == "missing_bias"
        assert fd.ref_value is not None and fd.cand_value is not None  # recovered by a re-run if evicted
    got = {(s.ref_name, s.cand_name): s.stats.max_abs for s in lock.stages if s.stats is not None}
    want = {(s.ref_name, s.cand_name): s.stats.max_abs for s in seq.stages if s.stats is not None}
    assert got == want


def test_lockstep_unseeded_random_reference_is_diffed_reference_first():
    # models given as objects are not seeded: the candidate continues the generators where the whole
    # reference left them, which a side-by-side run cannot reproduce, so the diff is made again in order
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            for _ in range(6):
                x = torch.nn.functional.dropout(self.lin(x), p=0.5, training=True)
            return x

    x = torch.randn(64, 256)
    kw = dict(max_memory=3 * _ROW, health=False, rerun=False, trials=1)
    torch.manual_seed(1)
    seq = diffkit.compare(Noisy(), Noisy(), [x], lockstep=False, **kw)
    torch.manual_seed(1)
    lock = diffkit.compare(Noisy(), Noisy(), [x], **kw)
    assert "lockstep" not in lock.meta and _key(lock) == _key(seq) and lock.verdict == "diverged"


def test_lockstep_hands_control_over_per_batch_of_records_not_per_record(monkeypatch):
    # 48 records of 32 KiB against a budget of 16: once the reference's budget is full, the candidate
    # frees LOW_WATER's share of it before the reference runs on, so each switch moves a batch of records
    # (one switch per record past the budget before); the candidate below is written otherwise
    # (parameter lists, torch.addmm with the weight read transposed)
    from diffkit import traces

    torch.manual_seed(0)
    width, depth = 64, 48

    class Chain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.steps = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

        def forward(self, x):
            for step in self.steps:
                x = torch.tanh(step(x))
            return x

    class ChainNew(torch.nn.Module):
        def __init__(self, ref):
            super().__init__()
            self.w = torch.nn.ParameterList(torch.nn.Parameter(s.weight.detach().clone()) for s in ref.steps)
            self.b = torch.nn.ParameterList(torch.nn.Parameter(s.bias.detach().clone()) for s in ref.steps)

        def forward(self, h):
            for w, b in zip(self.w, self.b):
                h = torch.addmm(b, h, w.t()).tanh()
            return h

    ref = Chain()
    x = torch.randn(128, width)
    row = x.numel() * 4
    kw = dict(max_memory=16 * row, health=False, rerun=False, trials=1)
    monkeypatch.setattr(traces, "LOCKSTEP_LOW_WATER", 4)  # 4 records' room before the reference runs on
    lock = diffkit.compare(ref, ChainNew(ref), [x], **kw)
    seq = diffkit.compare(ref, ChainNew(ref), [x], lockstep=False, **kw)
    past = 2 * depth - 16  # reference records (linear, tanh) that did not fit at first
    # a round trip (two switches) per record past the budget before; now one per batch of records (4 freed
    # less the values the report's window holds): at least three records a round trip
    assert 2 <= lock.meta["lockstep"]["switches"] <= 2 * past // 3, lock.meta["lockstep"]
    assert lock.verdict == "match" and _key(lock) == _key(seq)
    got = {(s.ref_name, s.cand_name): s.stats.max_abs for s in lock.stages if s.stats is not None}
    assert got == {(s.ref_name, s.cand_name): s.stats.max_abs for s in seq.stages if s.stats is not None}


_WRITES_LATER_REF = """
import torch

class Model(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.inner = torch.nn.Linear(n, n)
        self.outer = torch.nn.Linear(n, n)

    def forward(self, x):
        h = self.inner(x)
        doubled = h * 2.0
        h.mul_(0.0)  # the recorded value is written over afterwards, in place
        g = torch.relu(self.outer(doubled))
        return g + h

def get_inputs():
    return [torch.randn(16, 48)]

def get_init_inputs():
    return [48]
"""
_WRITES_LATER_NEW = """
import torch
import torch.nn.functional as F

class ModelNew(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.inner = torch.nn.Linear(n, n)
        self.outer = torch.nn.Linear(n, n)

    def forward(self, inp):
        pre = F.linear(inp, self.inner.weight, None if DROP_BIAS else self.inner.bias)
        twice = pre + pre
        pre.data.zero_()  # written over through .data (another version counter, the same memory)
        act = F.linear(twice, self.outer.weight, self.outer.bias)
        act.clamp_(min=0)
        return act + pre
"""


@pytest.mark.parametrize("drop_bias", [False, True])
def test_streaming_keeps_values_as_recorded_when_the_forward_writes_over_them_later(tmp_path, drop_bias):
    # the streaming stores keep a record's tensor without a copy (the capture copies it before a write
    # into its memory): what is measured and shown must be the value as it was made
    ref, new = tmp_path / "ref.py", tmp_path / "new.py"
    ref.write_text(_WRITES_LATER_REF)
    new.write_text(f"DROP_BIAS = {drop_bias}\n" + _WRITES_LATER_NEW)
    full = diffkit.diff_files(str(ref), str(new), health=False, rerun=False, trials=1)
    s = diffkit.diff_files(str(ref), str(new), health=False, rerun=False, trials=1, max_memory=8 << 20)
    assert s.meta["mode"] == "streaming" and set(s.meta["reference_tiers"]) == {"device"}
    assert _key(s) == _key(full)
    fm = {(x.ref_name, x.cand_name): (x.stats.max_abs, x.stats.mismatches) for x in full.stages if x.stats}
    sm = {(x.ref_name, x.cand_name): (x.stats.max_abs, x.stats.mismatches) for x in s.stages if x.stats}
    assert fm == sm
    inner = next(x for x in s.stages if x.ref_name == "inner")
    assert inner.stats.max_abs > 0 if drop_bias else inner.stats.max_abs == 0
    if drop_bias:
        fd = s.first_divergence
        assert fd.ref_name == "inner" and fd.diagnosis[0].kind == "missing_bias"
        assert torch.equal(fd.ref_value, full.first_divergence.ref_value)
        assert torch.equal(fd.cand_value, full.first_divergence.cand_value) and fd.cand_value.abs().sum() > 0
    else:
        assert s.verdict == full.verdict == "match"


_STATS_READ_EARLY_REF = """
import torch

class Model(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(width)
        self.mlp = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
        with torch.no_grad():
            self.norm.running_mean.fill_(0.25)

    def forward(self, x):
        center = self.norm.running_mean.view(1, -1)  # a view of a buffer, read before the update
        y = self.norm(x)  # training mode: running_mean is updated in place, unversioned
        return torch.tanh(self.mlp(y - center))

def get_inputs():
    return [torch.randn(64, 24) + 3]

def get_init_inputs():
    return [24]
"""
_STATS_READ_EARLY_NEW = """
import torch
import torch.nn.functional as F

class ModelNew(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(width)
        self.mlp = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
        with torch.no_grad():
            self.norm.running_mean.fill_(0.25)

    def forward(self, x):
        center = self.norm.running_mean.unsqueeze(0)  # (the same name: paired, and measured, as it is made)
        z = F.batch_norm(x, self.norm.running_mean, self.norm.running_var, self.norm.weight, self.norm.bias,
                         training=True, momentum=self.norm.momentum, eps=self.norm.eps) - center
        for lin in self.mlp:
            z = F.linear(z, lin.weight, lin.bias)
        return z.tanh()
"""


@pytest.mark.parametrize("mode", ["64M", "20K", "isolated"])
def test_a_buffer_view_is_kept_as_read_before_an_unversioned_update(tmp_path, mode):
    # batch norm's running statistics are updated from C++ without moving their version: a record in a
    # buffer's memory is copied as it is made, in the streaming stores (else held as it is, it became the
    # updated value before it was measured) as in memory (else the same: the isolated reference's
    # process, which writes its values as they are made, disagreed with the candidate's lazily kept one)
    ref, new = tmp_path / "ref.py", tmp_path / "new.py"
    ref.write_text(_STATS_READ_EARLY_REF)
    new.write_text(_STATS_READ_EARLY_NEW)
    if mode == "isolated":
        out = tmp_path / "r.json"
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(ref), str(new), "--trials",
                               "1", "--no-report", "--json", str(out)], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        results = [diffkit.Result.from_json(out.read_text())]
    else:
        budget = {"64M": 64 << 20, "20K": 20 << 10}[mode]
        s = diffkit.diff_files(str(ref), str(new), health=False, rerun=False, trials=1, max_memory=budget)
        assert s.meta["mode"] == "streaming"
        results = [diffkit.diff_files(str(ref), str(new), health=False, rerun=False, trials=1), s]
    for r in results:
        assert r.verdict == "match" and not r.diverged_stages and not any("overwritten" in w for w in r.warnings)
        center = next(x for x in r.stages if x.ref_name == "forward:center")
        assert center.cand_name == "forward:center" and center.stats.max_abs == 0


_STATS_ELSEWHERE = """
import torch
import torch.nn.functional as F

class {cls}(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norms = [torch.nn.BatchNorm1d(width)]  # a plain list: no submodule, its buffers not the model's
        self.width = width

    def forward(self, x):
        stats = torch.full((self.width,), 0.25)  # running statistics made in the forward
        spread = torch.ones(self.width)
        ahead = stats.view(1, -1)
        y = F.batch_norm(x, stats, spread, training=True, momentum=0.5)  # updates stats and spread, unversioned
        norm = self.norms[0]
        center = norm.running_mean.view(1, -1)
        z = norm(y * 2 + 1)  # the module updates its running_mean, unversioned
        shifted = z - center  # (compared, not returned: the list's module keeps its statistics across calls)
        return shifted * 0 + z + ahead

def get_inputs():
    return [torch.randn(32, 16) + 2]

def get_init_inputs():
    return [16]
"""


@pytest.mark.parametrize("isolate", [True, False])
def test_running_statistics_outside_the_models_buffers_are_kept_as_read(tmp_path, isolate):
    # what batch norm updates unseen is whatever tensor it is handed (made in the forward, or the buffer of
    # a module held in a plain list): a record there is copied before the call, as it was when read
    ref, new = tmp_path / "ref.py", tmp_path / "new.py"
    ref.write_text(_STATS_ELSEWHERE.format(cls="Model"))
    new.write_text(_STATS_ELSEWHERE.format(cls="ModelNew"))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", str(ref), str(new), "--trials", "1",
                           "--no-report", "--json", str(out)] + ([] if isolate else ["--no-isolate"]),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = diffkit.Result.from_json(out.read_text())
    assert r.verdict == "match" and not r.diverged_stages and not any("overwritten" in w for w in r.warnings)
    names = {x.ref_name for x in r.stages if x.stats is not None and x.stats.max_abs == 0}
    assert {"forward:stats", "forward:ahead", "forward:center"} <= names, [(x.ref_name, x.status) for x in r.stages]


def test_streaming_store_holds_no_more_memory_than_its_budget_counts():
    # a record that is a view of part of a larger result (heads cut out of one projection) is copied:
    # held as it is, it would keep the whole projection's memory, which the budget does not count
    from diffkit.pipeline import run_captured

    torch.manual_seed(0)
    proj = torch.nn.ModuleList(torch.nn.Linear(128, 512) for _ in range(6))

    class Heads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = proj

        def forward(self, x):
            acc = torch.zeros(x.shape[0], 16)
            for p in self.proj:
                both = p(x)
                acc = acc + both[:, :16] * both[:, 16:32]
            return acc

    store = TieredStore(Budget(8 << 20))
    run_captured(Heads(), [torch.randn(256, 128)], sink=store)
    held = {}
    for key in store.slots:
        st = store.get(key).untyped_storage()
        held[st.data_ptr()] = st.nbytes()
    assert len(store.slots) >= 18 and sum(held.values()) <= store.device_budget.used


@pytest.mark.parametrize("side", ["ref", "cand"])
def test_lockstep_a_side_failing_mid_forward_is_reported(tmp_path, side):
    ref, new = _noisy_files(tmp_path, ref_fail=4 if side == "ref" else None, cand_fail=4 if side == "cand" else None)
    r = diffkit.diff_files(ref, new, max_memory=3 * _ROW, health=False, rerun=False, trials=1)
    assert r.verdict == "error" and "layer 4 is broken" in r.error.message
    assert r.error.side == ("reference" if side == "ref" else "candidate")
    # both sides' capture hooks are gone: nothing is left recording
    assert not sys.modules["diffkit.capture"]._ACTIVE
    assert not torch.nn.modules.module._global_forward_hooks and not torch.nn.modules.module._global_forward_pre_hooks


def test_store_gives_back_a_transposed_value_in_its_layout(tmp_path):
    # a kernel may read its input through its strides: a value spilled in logical order comes back in
    # the layout it was made in (a replay must see what the run saw); one whose elements overlap comes
    # back contiguous, as `clone` makes it
    store = TieredStore(Budget(0), spill_dir=str(tmp_path))
    grid = torch.randn(3, 5, 7)
    swapped, wide = grid.transpose(0, 2), torch.randn(5, 1).expand(5, 4)
    for key, value in enumerate((swapped, grid, wide)):
        store.put(key, value)
        assert store.slots[key].tier == "disk"
    back = store.get(0)
    assert back.stride() == swapped.stride() and torch.equal(back, swapped)
    assert store.get(1).is_contiguous() and torch.equal(store.get(1), grid)
    assert store.get(2).is_contiguous() and torch.equal(store.get(2), wide)



def test_disk_tier_written_behind_keeps_each_value_as_it_was_put(tmp_path, monkeypatch):
    # the spiller copies a value through a ring smaller than the value and writes it on its own thread:
    # what comes back is the value as it was when put, whatever happens to the tensor afterwards, for
    # every dtype and size; a value dropped (or put again) while its file is on its way is gone after
    from diffkit import tiers

    monkeypatch.setattr(tiers._Spiller, "PIECE", 4096)
    monkeypatch.setattr(tiers._Spiller, "BUFFERS", 2)
    store = TieredStore(Budget(0), spill_dir=str(tmp_path))
    g = torch.Generator().manual_seed(5)
    values = {
        0: torch.randn(3000, generator=g),  # several pieces
        1: torch.randint(-9, 9, (40, 33), generator=g, dtype=torch.int64).t(),  # transposed, several pieces
        2: torch.randn(17, generator=g).half(),
        3: torch.rand(1000, generator=g) > 0.5,
        4: torch.randn(6, 2, generator=g, dtype=torch.complex64).conj(),
        5: torch.empty(0, 4),
        6: torch.tensor(2.5, dtype=torch.float64),
    }
    kept = {k: v.clone() for k, v in values.items()}
    for k, v in values.items():
        store.put(k, v)
        if v.numel() and v.dtype.is_floating_point:
            v.mul_(-3)  # the forward goes on writing into it
    store.put(7, torch.ones(5000))
    store.drop(7)  # (most likely still being written)
    store.put(0, kept[0] + 1)  # a second value under a key replaces the first
    kept[0] = kept[0] + 1
    for k, want in kept.items():
        got = store.get(k)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), k
    assert store.get(1).stride() == values[1].stride()
    store.clear()
    assert not os.listdir(tmp_path)


def test_disk_tier_write_failure_is_raised_where_the_value_is_wanted(tmp_path, monkeypatch):
    from diffkit import stream

    store = TieredStore(Budget(0), spill_dir=str(tmp_path))
    real = os.write

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(stream.os, "write", full)
    store.put(0, torch.randn(100))
    with pytest.raises(OSError, match="could not write a value spilled.*No space left"):
        store.get(0)
    monkeypatch.setattr(stream.os, "write", real)
    later = torch.randn(100)
    store.put(1, later)  # a write after the failure that succeeds is read back (only the failed one raises)
    assert torch.equal(store.get(1), later)
    store.drop(0)
    store.clear()
    assert not os.listdir(tmp_path)


_HEADS_REF = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(width)
        self.to_qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        packed = self.to_qkv(self.norm(x)).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(packed[0], packed[1], packed[2])
        return self.out(o.transpose(1, 2).reshape(b, n, c))


def get_inputs():
    return [torch.randn(2, 12, 32)]  # 12 tokens = 3 x 4 heads


def get_init_inputs():
    return [32, 4]
"""

# the projection takes the name the reference gives its head split, on the tokens flattened to rows:
# [24, 96] multiplies out like the reference's [3, 2, 4, 12, 8] (3 x 2 x 4 = 24), in another order
_HEADS_NEW = """
import torch
import torch.nn.functional as F


class ModelNew(torch.nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(width)
        self.to_qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x):
        b, n, c = x.shape
        rows = F.layer_norm(x.reshape(b * n, c), (c,), self.norm.weight, self.norm.bias)
        packed = F.linear(rows, self.to_qkv.weight)  # the bias left out
        q, k, v = packed.view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.softmax(q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5, dim=-1)
        return F.linear((att @ v).permute(0, 2, 1, 3).reshape(b, n, c), self.out.weight, self.out.bias)
"""


def test_streaming_does_not_pair_a_name_across_a_head_split(tmp_path):
    ref, new = tmp_path / "heads_ref.py", tmp_path / "heads_new.py"
    ref.write_text(_HEADS_REF)
    new.write_text(_HEADS_NEW)
    full = diffkit.diff_files(str(ref), str(new), trials=1)
    assert full.first_divergence.ref_name == "to_qkv" and full.first_divergence.diagnosis[0].kind == "missing_bias"
    for budget in (1 << 20, 16 << 10):  # everything fits; most values spill
        s = diffkit.diff_files(str(ref), str(new), trials=1, max_memory=budget)
        assert _key(s) == _key(full), budget


@pytest.mark.slow  # builds kernels/fused's C++ extension when no test has yet
def test_streaming_leaves_a_fused_call_to_align(tmp_path):
    # one extension call reads every parameter of the block: a superset of what the reference's first
    # stage (ln1) reads, on the same input and in the same shape, which is no reason to pair the two
    new = tmp_path / "block_fused_new.py"
    new.write_text(f"""
import runpy
import torch

_OPS = runpy.run_path({os.path.join(ROOT, "kernels", "fused", "_ops.py")!r})
_EXT = _OPS["load"]()


def _block(ext, m, x):
    p = dict(m.named_parameters())
    return ext.transformer_block(x, p["ln1.weight"], p["ln1.bias"], m.ln1.eps, p["qkv.weight"], p["qkv.bias"],
                                 p["proj.weight"], p["proj.bias"], p["ln2.weight"], p["ln2.bias"], m.ln2.eps,
                                 p["fc1.weight"], p["fc1.bias"], p["fc2.weight"], p["fc2.bias"], m.heads, 0)


class ModelNew(torch.nn.Module):
    def __init__(self, dim, heads, mlp_ratio):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = torch.nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x):
        return _block(_EXT, self, x)
""")
    ref = os.path.join(ROOT, "references", "transformer_block.py")
    full = diffkit.diff_files(ref, str(new), trials=1)
    s = diffkit.diff_files(ref, str(new), trials=1, max_memory=1 << 20)
    assert full.verdict == "match" and _key(s) == _key(full)


_ROWS_REF = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.proj(x))
        return self.head(h)


def get_inputs():
    return [torch.randn(2, 6, 16)]


def get_init_inputs():
    return []
"""

# right, with the tokens in sequence-major rows: its `h` [12, 16] is the reference's [2, 6, 16] only
# after the rows are put back in batch-major order
_ROWS_NEW = """
import torch


class ModelNew(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        b, s, c = x.shape
        tokens = x.transpose(0, 1).reshape(s * b, c)
        h = torch.tanh(torch.addmm(self.proj.bias, tokens, self.proj.weight.t()))
        out = torch.addmm(self.head.bias, h, self.head.weight.t())
        return out.view(s, b, -1).transpose(0, 1)
"""


def test_streaming_finds_a_permuted_layout_from_the_metrics(tmp_path, monkeypatch):
    # the pair is measured as a plain reshape first; its metrics disagree, so the layout search runs
    # then (no wait for the device when the reshape is right) and the pair is measured again in it
    from diffkit import stream

    ref, new = tmp_path / "rows_ref.py", tmp_path / "rows_new.py"
    ref.write_text(_ROWS_REF)
    new.write_text(_ROWS_NEW)
    searched = []
    real = stream.permuted_or_plain
    monkeypatch.setattr(stream, "permuted_or_plain", lambda *a: searched.append(real(*a)) or searched[-1])
    full = diffkit.diff_files(str(ref), str(new), trials=1)
    s = diffkit.diff_files(str(ref), str(new), trials=1, max_memory=1 << 20)
    assert full.verdict == "match" and _key(s) == _key(full)
    assert any(layout.transform[0] == "unpermute" for layout in searched)
    got = {x.ref_name: x.stats.max_abs for x in s.stages if x.stats is not None}
    assert got["forward:h"] < 1e-6


# the gate's input is scaled after its projection; the candidate folds the scale into one addmm and names
# the result as the reference names the unscaled projection (`z`): a name pair made while the records
# stream in, with its consumer (the candidate's output) then paired with the scaled tensor by dataflow
_GATED_REF = """
import torch


class Model(torch.nn.Module):
    def __init__(self, n_in, n_out, gain):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)
        self.gain = gain

    def forward(self, inp):
        z = self.lin(inp)
        z = z * self.gain
        return z * torch.sigmoid(z)


def get_inputs():
    return [torch.randn(12, 40)]


def get_init_inputs():
    return [40, 24, 0.25]
"""

_GATED_NEW = """
import torch
import torch.nn.functional as F


class ModelNew(torch.nn.Module):
    def __init__(self, n_in, n_out, gain):
        super().__init__()
        self.lin = torch.nn.Linear(n_in, n_out)
        self.gain = gain

    def forward(self, inp):
        z = torch.addmm(self.lin.bias * self.gain, inp, self.lin.weight.t(), alpha=self.gain)
        return F.silu(z)
"""


def test_streaming_pairs_the_outputs_whatever_paired_them_on_the_way(tmp_path):
    ref, new = tmp_path / "gated_ref.py", tmp_path / "gated_new.py"
    ref.write_text(_GATED_REF)
    new.write_text(_GATED_NEW)
    full = diffkit.diff_files(str(ref), str(new), trials=2)
    assert full.verdict == "match" and full.error is None
    for budget in (1 << 20, 2 << 10):  # everything fits; most values spill
        s = diffkit.diff_files(str(ref), str(new), trials=2, max_memory=budget)
        assert s.verdict == "match" and s.error is None, (budget, s.error)
        assert _key(s) == _key(full), budget
        out = next(x for x in s.stages if x.ref_name == "output")
        assert out.cand_name == "output" and out.stats.max_abs < 1e-5
