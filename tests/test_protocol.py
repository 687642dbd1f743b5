"""KernelBench's correctness protocol (issue 13): models as constructed (no eval()), nothing copied,
five trials on KernelBench's seeds, the candidate run twice per trial -- and diffkit's verdict equal
to KernelBench's own procedure on every bundled candidate."""
import json
import os

import pytest
import torch

import diffkit
from diffkit.load import compare_weights, describe_difference
from diffkit.options import Options
from diffkit.result import Result
from diffkit.trials import trial_seeds

from conftest import KERNELS, REFS, candidates, diff_once, run_cli, same_pair


# ----------------------------------------------------------------------------- KernelBench, re-implemented
def _exec(path):
    ctx = {"__file__": path, "__name__": "kernelbench_" + os.path.splitext(os.path.basename(path))[0]}
    with open(path, encoding="utf-8") as fh:
        exec(compile(fh.read(), path, "exec"), ctx)
    return ctx


def _kernelbench_models(ref, cand, seed=42):
    """The two models as KernelBench builds them from the executed files: seeded before get_init_inputs(),
    before Model(*init) and before ModelNew(*init)."""
    torch.manual_seed(seed)
    init = ref["get_init_inputs"]()
    with torch.no_grad():
        torch.manual_seed(seed)
        model = ref["Model"](*init)
        torch.manual_seed(seed)
        new = cand["ModelNew"](*init)
    return model, new


def kernelbench_passes(ref_path, cand_path, num_trials=5, seed=42):
    """KernelBench's correctness check as field.md states it: seed 42 before get_init_inputs(), before
    Model(*init) and before ModelNew(*init); no eval(), nothing copied; one seed per trial from
    torch.manual_seed(42) and torch.randint(0, 2**32 - 1, (1,)); each trial seeds get_inputs(), runs
    both models on the same inputs under no_grad and passes when torch.allclose accepts the output at
    1e-4 (float32) / 1e-2 (half).  A candidate that fails to build or raises fails."""
    ref = _exec(ref_path)
    try:
        model, new = _kernelbench_models(ref, _exec(cand_path), seed)
    except Exception:
        return False
    torch.manual_seed(seed)
    seeds = [torch.randint(0, 2 ** 32 - 1, (1,)).item() for _ in range(num_trials)]
    passed = 0
    with torch.no_grad():
        for s in seeds:
            torch.manual_seed(s)
            inputs = ref["get_inputs"]()
            torch.manual_seed(s)
            out = model(*inputs)
            try:
                new_out = new(*inputs)
                if out.shape != new_out.shape:
                    return False
                tol = 1e-2 if out.dtype in (torch.float16, torch.bfloat16) else 1e-4
                passed += bool(torch.allclose(out, new_out, atol=tol, rtol=tol))
            except Exception:
                return False
    return passed == num_trials


CPU = [pytest.param(*c, id=c[0], marks=same_pair(c[2])) for c in candidates()]


@pytest.mark.parametrize("name,ref,cand,exp", CPU)
def test_verdict_agrees_with_kernelbench(name, ref, cand, exp, ops):
    kernelbench = kernelbench_passes(ref, cand)
    result = diff_once(ref, cand)  # (the Result test_diff, test_rootcause and test_pipeline read)
    assert (result.verdict == "match") == kernelbench, (kernelbench, result.summary_line())
    assert len(result.trials) == 5 or result.verdict != "match"


def test_trial_seeds_are_kernelbench_s_and_leave_the_global_generator_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    seeds = trial_seeds(5)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(42)
    assert seeds == [torch.randint(0, 2 ** 32 - 1, (1,)).item() for _ in range(5)]
    assert trial_seeds(3, seed=7) != seeds[:3]


# ----------------------------------------------------------------------------- the CLI, as users run it
def _diff_json(*args, tmp_path, name="r.json"):
    """`diffkit diff ARGS --json TMP/NAME --no-report`: the process and the JSON it wrote (None if none)."""
    out = tmp_path / name
    proc = run_cli("diff", *args, "--json", str(out), "--no-report")
    data = json.loads(out.read_text()) if out.exists() else None
    return proc, data


def test_batchnorm_with_running_statistics_diverges_in_every_trial(tmp_path, ops):
    ref, cand = os.path.join(REFS, "gemm_batchnorm_softmax.py"), os.path.join(KERNELS,
                                                                            "gemm_batchnorm_softmax_running_stats.py")
    proc, data = _diff_json(ref, cand, tmp_path=tmp_path)
    assert proc.returncode == 1 and data["verdict"] == "diverged", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert data["first_divergence"]["ref_name"] == "bn"
    assert len(data["trials"]) == 5 and not any(t["allclose"] for t in data["trials"])
    assert any("training mode" in w and "--eval" in w for w in data["warnings"])
    # in eval mode both normalise with the running statistics: the same candidate passes
    proc, data = _diff_json(ref, cand, "--eval", tmp_path=tmp_path, name="eval.json")
    assert proc.returncode == 0 and data["verdict"] == "match", proc.stdout[-2000:]
    assert data["meta"]["protocol"]["eval"] is True


def test_constant_folded_into_a_bias_at_construction_matches(tmp_path):
    ref, cand = os.path.join(REFS, "conv_tanh_pool.py"), os.path.join(KERNELS, "conv_tanh_pool_fused.py")
    proc, data = _diff_json(ref, cand, tmp_path=tmp_path)
    assert proc.returncode == 0 and data["verdict"] == "match", proc.stdout[-2000:] + proc.stderr[-2000:]
    (differ,) = data["weights"]["differ"]
    assert differ["name"] == "conv.bias" and differ["looks_like"].startswith("constant shift by -0.5")
    assert not data["weights"]["copied"] and not data["weights"]["synced"]
    assert any("conv.bias (constant shift by -0.5" in w for w in data["warnings"])
    # copying the reference's weights over it (the old default) breaks it
    proc, data = _diff_json(ref, cand, "--sync-weights", tmp_path=tmp_path, name="sync.json")
    assert proc.returncode == 1 and data["verdict"] == "diverged"
    assert data["weights"]["copied"] == ["conv.bias"]


def _first_trial_with_input_below(ref_path, threshold, n=5):
    """1-based number of the first trial whose inputs reach below `threshold` (from the reference's own
    get_inputs() under KernelBench's seeds), and whether trial 1's do."""
    ns = _exec(ref_path)
    hits = []
    for s in trial_seeds(n):
        torch.manual_seed(s)
        hits.append(bool((ns["get_inputs"]()[0] < threshold).any()))
    return hits.index(True) + 1 if any(hits) else None, hits


def test_bug_beyond_an_input_range_is_found_by_a_later_trial_and_named(tmp_path):
    ref, cand = os.path.join(REFS, "gelu.py"), os.path.join(KERNELS, "gelu_tail_fast_path.py")
    first, hits = _first_trial_with_input_below(ref, -3.0)
    assert first is not None and not hits[0], "precondition: trial 1's inputs never reach the broken range"
    proc, data = _diff_json(ref, cand, tmp_path=tmp_path)
    assert proc.returncode == 1 and data["verdict"] == "diverged", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [not t["allclose"] for t in data["trials"]] == hits
    seed = data["trials"][first - 1]["seed"]
    assert data["meta"]["trials"]["reported"] == first
    assert f"diverges on trial {first} of 5 (seed {seed})" in data["summary"]
    assert data["first_divergence"]["ref_name"] == "output"
    for t in data["trials"]:
        assert set(t) >= {"seed", "max_abs", "mean_abs", "allclose"}
    # one trial (the old protocol) does not see it
    proc, data = _diff_json(ref, cand, "--trials", "1", tmp_path=tmp_path, name="one.json")
    assert proc.returncode == 0 and data["verdict"] == "match" and len(data["trials"]) == 1


def test_nondeterministic_candidate_diverges_or_is_warned():
    racy = diffkit.diff_files(os.path.join(REFS, "transformer_block.py"),
                              os.path.join(KERNELS, "transformer_block_racy_softmax.py"))
    assert racy.verdict == "diverged" and racy.first_divergence.diagnosis[0].kind == "nondeterministic"
    assert all(t["nondeterministic"] for t in racy.trials)
    atomics = diffkit.diff_files(os.path.join(REFS, "row_softmax.py"), os.path.join(KERNELS, "row_softmax_fused.py"))
    assert atomics.verdict == "match", atomics.summary_line()
    assert any(f.kind == "nondeterministic" for f in atomics.findings)
    assert any("nondeterministic" in w and "within tolerance" in w for w in atomics.warnings)
    nd = [t["nondeterministic"] for t in atomics.trials if t["nondeterministic"]]
    assert nd and all(d["elements"] > 0 and d["at"] for d in nd)  # names the elements that differ


def test_nondeterministic_candidate_through_the_cli(tmp_path):
    proc, data = _diff_json(os.path.join(REFS, "row_softmax.py"), os.path.join(KERNELS, "row_softmax_fused.py"),
                            tmp_path=tmp_path)
    assert proc.returncode == 0 and data["verdict"] == "match"
    assert any(f["kind"] == "nondeterministic" for f in data["findings"])
    assert "nondeterministic" in proc.stdout


FIRST_CALL_WRONG = """
#include <torch/extension.h>
static int calls = 0;  // the first call reads a scratch value it never wrote; later calls are right
torch::Tensor twice(torch::Tensor x) {
    auto y = x * 2;
    if (++calls == 1) y.add_(1.0);
    return y;
}
"""


def test_a_replay_that_disagrees_with_the_run_is_nondeterministic():
    from torch.utils.cpp_extension import load_inline

    from diffkit.capture import register_extension

    ext = register_extension(load_inline(name="diffkit_test_first_call", cpp_sources=[FIRST_CALL_WRONG],
                                         functions=["twice"]))

    class Net(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.fn = fn

        def forward(self, x):
            y = self.fn(self.lin(x))
            return y.sum(-1)

    torch.manual_seed(0)
    ref = Net(lambda t: t * 2)
    cand = Net(None)
    cand.fn = lambda t: ext.twice(t)  # looked up at call time, so capture sees the extension call
    cand.load_state_dict(ref.state_dict())
    result = diffkit.compare(ref, cand, [torch.randn(4, 8)], rerun=False)
    fd = result.first_divergence
    assert result.verdict == "diverged" and fd.cand.op.endswith("twice"), result.summary_line()
    assert fd.local is not None and fd.local.ok  # re-run alone on the same inputs it is right
    assert fd.diagnosis[0].kind == "nondeterministic" and "same call gives other outputs" in fd.diagnosis[0].detail


def test_stochastic_reference_is_named_with_eval_as_the_way_out(tmp_path):
    ref = tmp_path / "drop.py"
    ref.write_text("import torch, torch.nn as nn\n"
                   "class Model(nn.Module):\n"
                   "    def __init__(self):\n        super().__init__(); self.lin = nn.Linear(16, 16); "
                   "self.drop = nn.Dropout(0.5)\n"
                   "    def forward(self, x):\n        return self.drop(self.lin(x))\n"
                   "def get_inputs():\n    return [torch.randn(8, 16)]\n"
                   "def get_init_inputs():\n    return []\n")
    cand = tmp_path / "cand.py"
    cand.write_text(ref.read_text().replace("class Model(", "class ModelNew("))
    result = diffkit.diff_files(str(ref), str(cand), trials=2)
    assert any("reference is random" in h and "drop (p=0.5)" in h and "--eval" in h for h in result.health), \
        result.health
    calm = diffkit.diff_files(str(ref), str(cand), trials=2, eval=True)
    assert calm.verdict == "match" and not any("random" in h for h in calm.health)


def test_a_reference_whose_randomness_stays_within_tolerance_is_not_said_to_be_unmatchable(tmp_path):
    """Noise far below the tolerance (no dropout): the health note says how far two runs differ and that a
    candidate can still match; it offers no --eval (there is no dropout for it to turn off)."""
    ref = tmp_path / "jitter.py"
    ref.write_text("import torch\n"
                   "class Model(torch.nn.Module):\n"
                   "    def __init__(self):\n        super().__init__(); self.lin = torch.nn.Linear(12, 12)\n"
                   "    def forward(self, x):\n        return torch.sigmoid(self.lin(x + 1e-6 * torch.randn_like(x)))\n"
                   "def get_inputs():\n    return [torch.randn(6, 12)]\n"
                   "def get_init_inputs():\n    return []\n")
    cand = tmp_path / "cand.py"
    cand.write_text(ref.read_text().replace("class Model(", "class ModelNew(").replace(" + 1e-6 * torch.randn_like(x)",
                                                                                      " + 1.5"))
    result = diffkit.diff_files(str(ref), str(cand), trials=1)  # (a diverging candidate: the second run is made)
    said = [h for h in result.health if "reference is random" in h]
    assert said and "can still match" in said[0] and "--eval" not in said[0], result.health


def test_trials_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        Options(trials=0)
    proc = run_cli("diff", os.path.join(REFS, "gelu.py"), os.path.join(KERNELS, "gelu_tail_fast_path.py"), "--trials",
                   "0")
    assert proc.returncode == 2 and "--trials" in proc.stderr and "Traceback" not in proc.stderr


def test_trials_survive_the_json_round_trip():
    result = diffkit.diff_files(os.path.join(REFS, "gelu.py"), os.path.join(KERNELS, "gelu_tail_fast_path.py"),
                                trials=3)
    back = Result.from_dict(json.loads(result.to_json()))
    assert back.trials == json.loads(result.to_json())["trials"] and len(back.trials) == 3
    assert back.summary_line() == result.summary_line()


def test_captured_reference_carries_its_trials(tmp_path):
    ref, cand = os.path.join(REFS, "gelu.py"), os.path.join(KERNELS, "gelu_tail_fast_path.py")
    dkt = tmp_path / "ref.dkt"
    proc = run_cli("capture", ref, "-o", str(dkt))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p for p in os.listdir(dkt) if p.startswith("trial-")) == [f"trial-{k}.dkt" for k in range(2, 6)]
    live = diffkit.diff_files(ref, cand)
    captured = diffkit.diff_files(str(dkt), cand)
    assert [t["allclose"] for t in captured.trials] == [t["allclose"] for t in live.trials]
    assert captured.meta["trials"]["reported"] == live.meta["trials"]["reported"]
    assert captured.summary_line() == live.summary_line()


def test_captures_alone_carry_every_trial(tmp_path):
    """The reference's file gone, and two captures with nothing re-run: the same trials, the same
    failing trial diffed stage by stage, the same answer."""
    from diffkit.compare import capture_reference

    src = tmp_path / "gelu_ref.py"
    src.write_text(open(os.path.join(REFS, "gelu.py"), encoding="utf-8").read())
    cand = os.path.join(KERNELS, "gelu_tail_fast_path.py")
    capture_reference(str(src), str(tmp_path / "ref.dkt"))
    capture_reference(cand, str(tmp_path / "cand.dkt"), class_name="ModelNew", inputs_from=str(src), side="candidate")
    live = diffkit.diff_files(str(src), cand)
    os.remove(src)
    against = diffkit.diff_files(str(tmp_path / "ref.dkt"), cand)
    two = diffkit.diff_files(str(tmp_path / "ref.dkt"), str(tmp_path / "cand.dkt"))
    for r in (against, two):
        assert r.verdict == "diverged" and r.meta["trials"]["reported"] == live.meta["trials"]["reported"] > 1
        assert [t["allclose"] for t in r.trials] == [t["allclose"] for t in live.trials]
        assert r.summary_line() == live.summary_line()


# ----------------------------------------------------------------------------- weights
def test_weight_differences_are_described():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    assert describe_difference(w, w + 0.25).startswith("constant shift by +0.25")
    assert describe_difference(w, w * -2).startswith("scaled by -2")
    sq = torch.randn(5, 5, generator=g)
    assert describe_difference(sq, sq.t().contiguous()) == "transposed"
    assert describe_difference(w, w[[1, 0, 2, 3, 4, 5]]).startswith("permuted along dim 0")
    assert "another random draw" in describe_difference(w, torch.randn(6, 5, generator=g))
    assert describe_difference(w, torch.zeros_like(w)) == "all zeros in the candidate"



class _Stack(torch.nn.Module):  # three layers under module names, in the order they are used
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.Tanh(), torch.nn.Linear(7, 7),
                                        torch.nn.Tanh(), torch.nn.Linear(7, 3))

    def forward(self, x):
        return self.body(x)


class _StackByHand(torch.nn.Module):  # raw parameters, other names, the last layer made first
    def __init__(self, renamed_only=False):
        super().__init__()
        make = lambda i, o: (torch.nn.Parameter(torch.empty(o, i)), torch.nn.Parameter(torch.empty(o)))  # noqa: E731
        order = [(9, 7), (7, 7), (7, 3)] if renamed_only else [(7, 3), (9, 7), (7, 7)]
        made = {}
        for i, o in order:
            w, b = make(i, o)
            torch.nn.init.kaiming_uniform_(w, a=5 ** 0.5)
            torch.nn.init.uniform_(b, -1 / i ** 0.5, 1 / i ** 0.5)
            made[(i, o)] = (w, b)
        (self.a_w, self.a_b), (self.b_w, self.b_b), (self.c_w, self.c_b) = made[(9, 7)], made[(7, 7)], made[(7, 3)]
        if not renamed_only:  # registration order = creation order, as a real class would have it
            for n in ("a_w", "a_b", "b_w", "b_b"):
                self.register_parameter(n, self._parameters.pop(n))

    def forward(self, x):
        h = torch.tanh(x @ self.a_w.t() + self.a_b)
        h = torch.tanh(torch.nn.functional.linear(h, self.b_w, self.b_b))
        return torch.addmm(self.c_b, h, self.c_w.t())


def test_parameters_created_in_another_order_are_named_and_paired_for_the_diff():
    torch.manual_seed(42)
    ref = _Stack()
    torch.manual_seed(42)
    same = _StackByHand(renamed_only=True)
    w = compare_weights(ref, same)
    assert w.renamed == [["a_w", "body.0.weight"], ["a_b", "body.0.bias"], ["b_w", "body.2.weight"],
                         ["b_b", "body.2.bias"], ["c_w", "body.4.weight"], ["c_b", "body.4.bias"]] and not w.order
    torch.manual_seed(42)
    other = _StackByHand()
    w = compare_weights(ref, other)
    assert "another order" in w.order and "c_w" in w.order and "body.0.weight" in w.order, w.summary()
    assert {(d["name"], d.get("reference")) for d in w.differ} >= {("a_w", "body.0.weight"), ("c_w", "body.4.weight")}
    assert w.to_dict()["order"] == w.order and type(w).from_dict(w.to_dict()).order == w.order
    # the diff pairs the layers by what they read (the two 7-element biases by the order they are read), and
    # the first stage is the first layer, wrong because its weights are
    x = torch.randn(4, 9)
    r = diffkit.compare(ref, other, [x])
    fd = r.first_divergence
    assert r.verdict == "diverged" and fd is not None and fd.ref_name in ("body.0", "body.1"), r.summary_line()
    assert fd.diagnosis and fd.diagnosis[0].kind == "other_weights", [f.kind for f in fd.diagnosis]
    assert "(reference body.0." in fd.diagnosis[0].detail, fd.diagnosis[0].detail
    # the same weights under other names: no finding
    assert diffkit.compare(ref, same, [x]).verdict == "match"


def test_nothing_is_copied_and_models_stay_as_constructed(tmp_path):
    ref = tmp_path / "ref.py"
    ref.write_text("import torch, torch.nn as nn\n"
                   "class Model(nn.Module):\n"
                   "    def __init__(self):\n        super().__init__(); self.a = nn.Linear(16, 16)\n"
                   "    def forward(self, x):\n        return self.a(x)\n"
                   "def get_inputs():\n    return [torch.randn(2, 16)]\n"
                   "def get_init_inputs():\n    return []\n")
    cand = tmp_path / "cand.py"
    cand.write_text(ref.read_text().replace("class Model(", "class ModelNew(").replace(
        "self.a = nn.Linear(16, 16)", "self.pad = nn.Parameter(torch.randn(1)); self.a = nn.Linear(16, 16)"))
    pair = diffkit.load_pair(str(ref), str(cand))
    assert pair.ref.training and pair.cand.training
    assert not torch.equal(pair.ref.a.weight, pair.cand.a.weight)  # drawn after an extra parameter
    assert {d["name"] for d in pair.weights.differ} == {"a.weight", "a.bias"} and not pair.weights.copied
    assert "another random draw" in pair.weights.differ[0]["looks_like"]
    result = diffkit.diff_files(str(ref), str(cand))
    assert result.verdict == "diverged" and any("a.weight" in w for w in result.warnings)


# ----------------------------------------------------------------------------- --sanitize: the candidate's kernels only
def test_sanitizer_instruments_only_the_candidate_s_kernels(monkeypatch):
    from diffkit import sanitize

    assert sanitize.candidate_kernels(os.path.join(KERNELS, "row_softmax_cuda_race.py")) == ["softmax_rows_kernel"]
    tri = sanitize.candidate_kernels(os.path.join(KERNELS, "transformer_block_triton.py"))
    assert {"softmax_rows_kernel", "bias_gelu_kernel"} <= set(tri)
    monkeypatch.setattr(sanitize, "find_tool", lambda: "/opt/cs/compute-sanitizer")
    monkeypatch.setattr(sanitize, "tool_version", lambda exe: (2025, 1))
    cmd = sanitize.wrap_command("racecheck", "/tmp/log", ["python", "x.py"], kernels=["k_one", "k_two"])
    i = cmd.index("--kernel-name")
    assert cmd[i + 1] == "regex=.*(k_one|k_two).*" and cmd[-2:] == ["python", "x.py"]
    monkeypatch.setattr(sanitize, "tool_version", lambda exe: (2022, 4))
    assert "--kernel-regex" in sanitize.wrap_command("racecheck", "/tmp/log", ["p"], kernels=["k_one"])


def test_race_report_names_the_shared_array(tmp_path):
    from diffkit.sanitize import parse, shared_array_of

    src = open(os.path.join(KERNELS, "row_softmax_cuda.py"), encoding="utf-8").read()
    cu = tmp_path / "cuda.cu"
    cu.write_text(src.split('r"""', 1)[1].split('"""', 1)[0])
    lines = cu.read_text().splitlines()
    write = next(i for i, ln in enumerate(lines, 1) if "red[tid] = m;" in ln)
    read = next(i for i, ln in enumerate(lines, 1) if "row_max = red[0]" in ln)
    log = (f"========= Error: Race reported between Write access at softmax_rows_kernel(const float *, float *, int, "
           f"int)+0x4a0 in {cu}:{write}\n"
           f"=========     and Read access at softmax_rows_kernel(const float *, float *, int, int)+0x2c0 in "
           f"{cu}:{read} [2040 hazards]\n")
    (rep,) = parse(log, "racecheck")
    assert rep.kernel == "softmax_rows_kernel" and rep.source.endswith(f":{write}") and rep.other_source.endswith(
        f":{read}")
    assert shared_array_of(rep, [cu.read_text()]).startswith("shared array red")
    rep.source = rep.other_source = ""  # no line info: the kernel's only shared array
    assert shared_array_of(rep, [cu.read_text()]) == "shared array red (the kernel's only one)"


class _Echo(torch.nn.Module):
    def forward(self, x):
        return x.clone()


class _Fixed(torch.nn.Module):
    """A candidate whose output is a fixed tensor (whatever its input)."""

    def __init__(self, value):
        super().__init__()
        self.register_buffer("value", value)

    def forward(self, x):
        return self.value.clone()


@pytest.mark.parametrize("ref_out,cand_out", [
    # half precision at the tolerance's edge: torch.allclose rounds |c - r| and its bound to float16
    (torch.tensor([0.000128984, 1.0], dtype=torch.float16), torch.tensor([0.0101318, 1.0], dtype=torch.float16)),
    (torch.tensor([0.000128984, 1.0], dtype=torch.float16), torch.tensor([0.0103, 1.0], dtype=torch.float16)),
    # the bound is on |candidate| (KernelBench passes the reference first)
    (torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([1.0 + 2.0001e-4, 2.0], dtype=torch.float64)),
    (torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([1.0 - 1.9999e-4, 2.0], dtype=torch.float64)),
    # integers are held to the tolerance, as torch.allclose holds them
    (torch.tensor([200000, 7]), torch.tensor([200010, 7])),
    (torch.tensor([200000, 7]), torch.tensor([200030, 7])),
    # complex64 in complex64
    (torch.tensor([1 + 1j], dtype=torch.complex64), torch.tensor([1 + 1j], dtype=torch.complex64) * (1 + 1e-4)),
])
def test_the_output_verdict_is_kernelbench_own_allclose_call(ref_out, cand_out):
    atol = rtol = 1e-2 if ref_out.dtype == torch.float16 else 1e-4
    expected = torch.allclose(ref_out, cand_out, atol=atol, rtol=rtol)  # as KernelBench's evaluator calls it
    for streaming in ({}, {"max_memory": 1 << 20}):
        result = diffkit.compare(_Echo(), _Fixed(cand_out), [ref_out], health=False, **streaming)
        assert result.verdict == ("match" if expected else "diverged"), (streaming, result.verdict, result.warnings)
        assert result.trials[0]["allclose"] is expected
        count_says = result.output.mismatches == 0
        # where the elementwise count (bound on |reference|, wider arithmetic) says otherwise, a warning says why
        assert any("the verdict follows KernelBench" in w for w in result.warnings) is (count_says != expected)
        back = diffkit.Result.from_dict(json.loads(json.dumps(result.to_dict())))  # as a suite reads it back
        assert back.output.ok is expected and back.verdict == result.verdict
    if ref_out.is_floating_point():  # --tolerance auto: the float64 rule decides, and no such warning is given
        auto = diffkit.compare(_Echo(), _Fixed(cand_out), [ref_out], health=False, tolerance="auto")
        assert not any("the verdict follows KernelBench" in w for w in auto.warnings)


# a reference whose output depends on a buffer its forward updates: each trial starts where the last one left it
COUNTING_REF = """
import torch, torch.nn as nn


class Model(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, 2 * width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        scaled = self.lin(x) * self.calls
        return torch.tanh(scaled) + 0.1 * scaled


def get_inputs():
    return [torch.randn(6, 12)]


def get_init_inputs():
    return [12]
"""

# the same computation written otherwise, wrong from its third call on (a counter it keeps as a float buffer)
COUNTING_CAND = """
import torch, torch.nn as nn
from torch.nn import functional as F


class ModelNew(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, 2 * width)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, inp):
        self.calls.add_(1.0)
        factor = self.calls + 0.05 if self.calls.item() > 2 else self.calls
        pre = torch.addmm(self.lin.bias, inp, self.lin.weight.t()).mul(factor)
        return pre.tanh().add(pre, alpha=0.1)
"""


def test_a_later_failing_trial_is_diffed_stage_by_stage_from_the_state_it_ran_in(tmp_path):
    """Trial 3 is the first to fail, and the reference's output depends on a buffer each forward updates:
    the trial diffed stage by stage starts from the buffers trial 3 started from (an isolated diff's
    reference process stores later trials as inputs and outputs only; the candidate's process reruns the
    reference from its capture), and names the stage the candidate got wrong, as one process does."""
    ref, cand = tmp_path / "counting_ref.py", tmp_path / "counting_cand.py"
    ref.write_text(COUNTING_REF)
    cand.write_text(COUNTING_CAND)
    # KernelBench's own five trials, by hand: the same two model objects, one forward each per trial
    ns_ref, ns_cand = _exec(str(ref)), _exec(str(cand))
    torch.manual_seed(42)
    ref_model = ns_ref["Model"](*ns_ref["get_init_inputs"]())
    torch.manual_seed(42)
    cand_model = ns_cand["ModelNew"](*ns_ref["get_init_inputs"]())
    expect = []
    for seed in trial_seeds(5):
        torch.manual_seed(seed)
        x = ns_ref["get_inputs"]()
        with torch.no_grad():
            expect.append((ref_model(*x) - cand_model(*x)).abs().max().item())
    answers = []
    for mode in ([], ["--no-isolate"]):
        proc, data = _diff_json(str(ref), str(cand), *mode, tmp_path=tmp_path, name=f"r{len(answers)}.json")
        assert proc.returncode == 1 and data["verdict"] == "diverged", proc.stdout[-2000:] + proc.stderr[-2000:]
        assert [t["allclose"] for t in data["trials"]] == [True, True, False, False, False]
        assert data["meta"]["trials"]["reported"] == 3
        assert data["first_divergence"]["ref_name"] == "forward:scaled", data["first_divergence"]
        # (re-running the candidate's `calls.add_(1.0)` for the root cause would count once more)
        assert data["root_cause"]["ref_name"] == "forward:scaled", data["root_cause"]
        assert not any("could not be rebuilt" in w for w in data["warnings"]), data["warnings"]
        assert [t["max_abs"] for t in data["trials"]] == pytest.approx(expect, rel=1e-5, abs=1e-7)
        answers.append([(s["ref_name"], s["cand_name"], s["status"], s["max_abs"]) for s in data["stages"]])
    assert answers[0] == answers[1]


# ----------------------------------------------------------------------------- the output's own form
FORM_MODEL = """
import torch, torch.nn as nn


class {cls}(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.proj = nn.Linear(n, n)

    def forward(self, x):
        h = torch.relu(self.proj(x))
        return {ret}


def get_inputs():
    return [torch.randn(3, 10)]


def get_init_inputs():
    return [10]
"""


@pytest.mark.parametrize("ref_ret,cand_ret,held", [
    ("h", "h,", "candidate"), ("h", "[h]", "candidate"), ("h", "{'y': h}", "candidate"), ("(h,)", "h", "reference")])
@pytest.mark.parametrize("mode", [[], ["--no-isolate"], ["--max-memory", "1M"]])
def test_a_bare_tensor_against_one_in_a_container_fails_as_kernelbench_fails_it(tmp_path, ref_ret, cand_ret, held,
                                                                               mode):
    """KernelBench's evaluator reads `output.shape`: the same values returned inside a tuple, list or dict fail
    there, so they diverge here, in every mode, with the side named."""
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(FORM_MODEL.format(cls="Model", ret=ref_ret))
    cand.write_text(FORM_MODEL.format(cls="ModelNew", ret=cand_ret))
    proc, data = _diff_json(str(ref), str(cand), *mode, tmp_path=tmp_path)
    assert proc.returncode == 1 and data["verdict"] == "diverged", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Output structure mismatch" in proc.stdout and "holding one tensor [3, 10]" in proc.stdout
    assert any(w.startswith(f"the {held} returns a ") and "output.shape" in w for w in data["warnings"])
    assert not data["trials"][0]["allclose"]


def test_both_returning_the_same_container_are_compared_tensor_by_tensor(tmp_path):
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(FORM_MODEL.format(cls="Model", ret="h, h.sum()"))
    cand.write_text(FORM_MODEL.format(cls="ModelNew", ret="(h, h.sum(0).sum())"))
    proc, data = _diff_json(str(ref), str(cand), tmp_path=tmp_path)
    assert proc.returncode == 0 and data["verdict"] == "match", proc.stdout[-2000:] + proc.stderr[-2000:]
    assert any("reference returns a tuple" in w and "KernelBench" in w for w in data["warnings"])
    # the one-line answer does not say KernelBench passes it: its evaluator fails every candidate of this reference
    headline = proc.stdout.strip().splitlines()[-1]
    assert "KernelBench trials" not in headline and "trials tensor by tensor (KernelBench's evaluator fails" in headline


def test_the_output_form_survives_two_captures(tmp_path):
    from diffkit.compare import capture_reference

    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(FORM_MODEL.format(cls="Model", ret="h"))
    cand.write_text(FORM_MODEL.format(cls="ModelNew", ret="[h]"))
    capture_reference(str(ref), str(tmp_path / "ref.dkt"))
    capture_reference(str(cand), str(tmp_path / "cand.dkt"), class_name="ModelNew", inputs_from=str(ref),
                      side="candidate")
    result = diffkit.diff_files(str(tmp_path / "ref.dkt"), str(tmp_path / "cand.dkt"))
    assert result.verdict == "diverged" and result.output_structure is not None
    assert "a list holding" in result.output_structure[1]


def test_a_reference_raising_on_trial_one_is_not_said_to_hold_too_few_trials(tmp_path):
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(FORM_MODEL.format(cls="Model", ret="h").replace("return h", "raise RuntimeError('no')"))
    cand.write_text(FORM_MODEL.format(cls="ModelNew", ret="h"))
    proc, data = _diff_json(str(ref), str(cand), tmp_path=tmp_path)
    assert proc.returncode == 2 and data["verdict"] == "error" and data["error"]["side"] == "reference"
    assert not any("--trials" in w for w in data["warnings"]), data["warnings"]


def test_the_same_tensor_returned_twice_counts_as_two_outputs():
    class Twice(torch.nn.Module):
        def forward(self, x):
            y = torch.tanh(x)
            return y, y

    class Copied(torch.nn.Module):
        def forward(self, x):
            y = torch.tanh(x)
            return y, y.clone()

    class Once(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x)

    x = torch.randn(3, 4)
    assert diffkit.compare(Twice(), Copied(), [x]).verdict == "match"
    assert diffkit.compare(Copied(), Twice(), [x]).verdict == "match"
    r = diffkit.compare(Once(), Twice(), [x])
    assert r.verdict == "diverged" and "2 tensors" in r.output_structure[1], r.output_structure


def test_a_forward_that_changes_its_own_attribute_is_said_to_keep_state_not_to_race():
    class Ref(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, x):
            return self.lin(x)

    class WarmUp(Ref):  # the first call takes another path, counted in a plain attribute
        def __init__(self):
            super().__init__()
            self.seen = 0

        def forward(self, x):
            self.seen += 1
            return torch.nn.functional.linear(x, self.lin.weight, None if self.seen == 1 else self.lin.bias)

    torch.manual_seed(0)
    ref = Ref()
    cand = WarmUp()
    cand.load_state_dict(ref.state_dict())
    r = diffkit.compare(ref, cand, [torch.randn(4, 6)])
    assert r.verdict == "diverged"
    kinds = [f.kind for f in r.findings]
    assert "stateful" in kinds and "nondeterministic" not in kinds, kinds
    assert "seen (0 → 1)" in next(f.detail for f in r.findings if f.kind == "stateful")
    # the finding is the answer's cause: every surface a reader sees says it (not only the JSON)
    from diffkit.render import notices, summary_markdown, text_report

    said = next(f.detail for f in r.findings if f.kind == "stateful")
    assert any(ln.startswith("finding: stateful") and said in ln for ln in text_report(r).splitlines())
    md = summary_markdown(r)
    assert "### Findings" in md and "seen (0 → 1)" in md.split("### Findings", 1)[1]
    assert any(said in n for n in notices(r))  # (the HTML report's and the notebook's list under the banner)


def test_weights_stored_in_another_layout_are_the_same_weights():
    # a candidate that keeps its weights transposed for x @ W (under other names) holds the reference's
    # values: no "other order", no other_weights finding, and a bug elsewhere is still the finding
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(10, 16), torch.nn.Linear(16, 10)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    class KeptTransposed(torch.nn.Module):
        def __init__(self, drop_last_bias=False):
            super().__init__()
            fc1, fc2 = torch.nn.Linear(10, 16), torch.nn.Linear(16, 10)
            self.w_in = torch.nn.Parameter(fc1.weight.detach().t().contiguous())
            self.b_in = torch.nn.Parameter(fc1.bias.detach().clone())
            self.w_out = torch.nn.Parameter(fc2.weight.detach().t().contiguous())
            self.b_out = torch.nn.Parameter(fc2.bias.detach().clone())
            self.drop = drop_last_bias

        def forward(self, x):
            h = torch.relu(x @ self.w_in + self.b_in)
            return h @ self.w_out + (0 if self.drop else self.b_out)

    torch.manual_seed(42)
    ref = Two()
    torch.manual_seed(42)
    ok = KeptTransposed()
    w = compare_weights(ref, ok)
    assert sorted(w.relaid) == [["w_in", "fc1.weight", "transposed"], ["w_out", "fc2.weight", "transposed"]], w.summary()
    assert not w.order and not w.differ, w.summary()
    x = torch.randn(3, 10)
    assert diffkit.compare(ref, ok, [x]).verdict == "match"
    torch.manual_seed(42)
    r = diffkit.compare(ref, KeptTransposed(drop_last_bias=True), [x])
    kinds = [f.kind for s in r.stages for f in s.diagnosis]
    assert r.verdict == "diverged" and "missing_bias" in kinds and "other_weights" not in kinds, kinds


# a reference whose forward changes the caller's tensors: KernelBench passes both models the same input
# tensors, so the candidate runs on them as the reference left them
SHIFTING_REF = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.shift = nn.Parameter(torch.randn(width))
        self.proj = nn.Linear(width, width)

    def forward(self, x, gain):
        x.add_(self.shift)
        gain.mul_(0.5)
        return self.proj(x) * gain


def get_inputs():
    return [torch.randn(6, 12), torch.rand(6, 1) + 0.5]


def get_init_inputs():
    return [12]
'''

# makes the reference's change itself, on tensors the reference has made it to already
REPEATS_THE_CHANGE = '''
import torch
import torch.nn.functional as F


class ModelNew(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.empty(width).normal_())
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x, gain):
        moved = torch.add(x, self.shift)
        return F.linear(moved, self.proj.weight, self.proj.bias) * (gain / 2)
'''

# takes the inputs as the reference leaves them (what KernelBench gives it)
RELIES_ON_THE_CHANGE = '''
import torch


class ModelNew(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.randn(width))
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x, gain):
        return torch.addmm(self.proj.bias, x, self.proj.weight.t()) * gain
'''


@pytest.mark.parametrize("mode", ["in-process", "streaming", "isolated", "captured"])
def test_a_reference_changing_its_inputs_hands_the_candidate_the_changed_inputs(tmp_path, mode):
    ref = tmp_path / "shifting.py"
    ref.write_text(SHIFTING_REF)
    for text, name in ((REPEATS_THE_CHANGE, "repeats"), (RELIES_ON_THE_CHANGE, "relies")):
        cand = tmp_path / f"{name}.py"
        cand.write_text(text)
        expected = kernelbench_passes(str(ref), str(cand))
        if mode in ("in-process", "streaming"):
            r = diffkit.diff_files(str(ref), str(cand), max_memory=1024 if mode == "streaming" else None)
            verdict, warnings, trials = r.verdict, r.warnings, r.trials
            first = r.first_divergence.ref_name if r.first_divergence is not None else None
            if mode == "in-process" and not expected:  # re-run on the inputs as the reference left them
                assert r.root_cause is r.first_divergence and r.first_divergence.local is not None, \
                    r.first_divergence.replay_note
        else:
            where = str(ref)
            if mode == "captured":  # the reference captured first, then diffed from its capture directory
                from diffkit.compare import capture_reference
                from diffkit.store import CaptureFile

                where = str(tmp_path / "ref.dkt")
                if not os.path.exists(where):
                    capture_reference(str(ref), where)
                left = CaptureFile.open(where).inputs_left()
                assert sorted(left) == ["input[0]", "input[1]"]
            proc, data = _diff_json(where, str(cand), tmp_path=tmp_path, name=f"{name}.json")
            assert data is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
            verdict, warnings, trials = data["verdict"], data["warnings"], data["trials"]
            first = (data.get("first_divergence") or {}).get("ref_name")
        assert (verdict == "match") == expected, (name, mode, verdict, warnings)
        assert any("changes its input[0], input[1] in place" in w and "KernelBench" in w for w in warnings), warnings
        if expected:
            assert len(trials) == 5 and all(t["allclose"] for t in trials)
        else:  # where the candidate makes the change a second time
            assert "add" in first, first
    assert {kernelbench_passes(str(ref), str(tmp_path / f"{n}.py")) for n in ("repeats", "relies")} == {True, False}


def test_a_candidate_s_capture_made_before_the_reference_s_change_is_said_to_differ_from_kernelbench(tmp_path):
    from diffkit.compare import capture_reference

    ref, cand = tmp_path / "shifting.py", tmp_path / "relies.py"
    ref.write_text(SHIFTING_REF)
    cand.write_text(RELIES_ON_THE_CHANGE)
    capture_reference(str(ref), str(tmp_path / "ref.dkt"))
    capture_reference(str(cand), str(tmp_path / "cand.dkt"), class_name="ModelNew", inputs_from=str(ref),
                      side="candidate")
    result = diffkit.diff_files(str(tmp_path / "ref.dkt"), str(tmp_path / "cand.dkt"))
    assert any("capture was made from the inputs as they were before" in w for w in result.warnings), result.warnings


def test_a_forward_leaving_its_inputs_alone_hands_them_over_as_they_were():
    # NaNs left where they were are no change; a view taken of an input is not a write into it
    class Reads(torch.nn.Module):
        def forward(self, x):
            return torch.nan_to_num(x.view(-1)[:5]) * 3

    x = torch.tensor([float("nan"), 1.0, 2.0, float("inf"), -1.0, 4.0])
    r = diffkit.compare(Reads(), Reads(), [x])
    assert r.verdict == "match" and not any("in place" in w for w in r.warnings), r.warnings


NOISY_REF = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.25)  # live: KernelBench never calls eval()

    def forward(self, x):
        return self.drop(torch.sigmoid(self.lin(x)))


def get_inputs():
    return [torch.randn(5, 16)]


def get_init_inputs():
    return [16]
'''

# the same computation, its dropout drawn in a generator scope of its own
NOISY_FORKED = '''
import torch
import torch.nn.functional as F


class ModelNew(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        with torch.random.fork_rng():
            return F.dropout(torch.sigmoid(F.linear(x, self.lin.weight, self.lin.bias)), 0.25, self.training)
'''


def _kernelbench_first_trial_error(ref_path, cand_path):
    """KernelBench's trial 1 as it runs it: seeded once, the reference's forward, then the candidate's."""
    ref = _exec(ref_path)
    model, new = _kernelbench_models(ref, _exec(cand_path))
    seed = trial_seeds(1)[0]
    with torch.no_grad():
        torch.manual_seed(seed)
        inputs = ref["get_inputs"]()
        torch.manual_seed(seed)
        out = model(*inputs)
        return float((new(*inputs) - out).abs().max())


@pytest.mark.parametrize("mode", ["in-process", "isolated", "streaming"])
def test_a_candidate_draws_where_the_reference_s_forward_left_the_generator(tmp_path, mode):
    ref, cand = tmp_path / "noisy.py", tmp_path / "forked.py"
    ref.write_text(NOISY_REF)
    cand.write_text(NOISY_FORKED)
    expected = kernelbench_passes(str(ref), str(cand))
    first = _kernelbench_first_trial_error(str(ref), str(cand))
    if mode == "isolated":
        proc, data = _diff_json(str(ref), str(cand), tmp_path=tmp_path)
        assert data is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
        verdict, trials = data["verdict"], data["trials"]
    else:
        r = diffkit.diff_files(str(ref), str(cand), max_memory=1024 if mode == "streaming" else None)
        verdict, trials = r.verdict, r.trials
    assert (verdict == "match") == expected and not expected, (mode, verdict)
    assert trials[0]["max_abs"] == pytest.approx(first, rel=1e-6), (trials[0], first)


NORMED_REF = '''
import torch
from torch import nn


class Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + self.bn(self.conv(x))


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.block = Residual(c)

    def forward(self, x):
        return torch.relu(self.block(x))


def get_inputs():
    return [torch.randn(2, 4, 6, 6)]


def get_init_inputs():
    return [4]
'''

# the residual left out: the block's last call is the BatchNorm, whose running statistics move in the forward as
# the reference's do
NORMED_NO_RESIDUAL = '''
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c))

    def forward(self, x):
        return self.block(x).clamp_min(0)
'''


@pytest.mark.parametrize("isolate", [True, False])
def test_running_statistics_moved_by_the_forwards_are_not_other_weights(tmp_path, isolate):
    ref, cand = tmp_path / "normed.py", tmp_path / "no_residual.py"
    ref.write_text(NORMED_REF)
    cand.write_text(NORMED_NO_RESIDUAL)
    proc, data = _diff_json(str(ref), str(cand), *([] if isolate else ["--no-isolate"]), tmp_path=tmp_path)
    assert data is not None and data["verdict"] == "diverged", proc.stdout[-2000:] + proc.stderr[-2000:]
    kinds = [f["kind"] for f in (data.get("first_divergence") or {}).get("diagnosis", [])]
    kinds += [f["kind"] for f in (data.get("root_cause") or {}).get("diagnosis", [])]
    assert "other_weights" not in kinds, data.get("first_divergence")


def test_a_candidate_given_inputs_of_its_own_keeps_them():
    class Halves(torch.nn.Module):
        def forward(self, x):
            x.mul_(0.5)
            return x + 1

    class Plus(torch.nn.Module):
        def forward(self, x):
            return x + 1

    x = torch.randn(4, 3)
    r = diffkit.compare(Halves(), Plus(), [x], cand_inputs=[x * 0.5])
    assert r.verdict == "match", r.summary_line()
    assert any("ran on the inputs it was given" in w for w in r.warnings), r.warnings


# lazy modules: placeholders with no shape or data until the first forward (KernelBench runs them as they are)
LAZY_NORM_REF = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv2d(3, c, 3, padding=1)
        self.norm = nn.LazyBatchNorm2d()

    def forward(self, x):
        return torch.relu(self.norm(self.conv(x)))


def get_inputs():
    return [torch.randn(2, 3, 8, 8)]


def get_init_inputs():
    return [6]
'''

# batch statistics by hand, no lazy module: the same numbers (training mode, weight 1, bias 0)
LAZY_NORM_BY_HAND = '''
import torch
import torch.nn.functional as F
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1)

    def forward(self, images):
        h = F.conv2d(images, self.conv.weight, self.conv.bias, padding=1)
        mu = h.mean(dim=(0, 2, 3), keepdim=True)
        var = h.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
        return ((h - mu) * torch.rsqrt(var + 1e-5)).clamp(min=0)
'''

# the same by hand with the variance's epsilon left out of the square root's argument (a wrong kernel)
LAZY_NORM_NO_EPS = LAZY_NORM_BY_HAND.replace("torch.rsqrt(var + 1e-5)", "(1.0 / (var.sqrt() + 1e-5))").replace(
    "h.var(dim=(0, 2, 3), unbiased=False, keepdim=True)", "h.var(dim=(0, 2, 3), unbiased=True, keepdim=True)")

# a lazy projection on both sides: each side's first forward draws its weights from the generator where it
# finds it (the candidate's after the reference's forward): other weights, as KernelBench finds them
LAZY_PROJ_REF = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, out_features):
        super().__init__()
        self.proj = nn.LazyLinear(out_features)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def get_inputs():
    return [torch.randn(4, 10)]


def get_init_inputs():
    return [5]
'''

LAZY_PROJ_CAND = '''
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self, n_out):
        super().__init__()
        self.layers = nn.Sequential(nn.LazyLinear(n_out), nn.Tanh())

    def forward(self, inp):
        return self.layers(inp)
'''


@pytest.mark.parametrize("ref_src,cand_src", [(LAZY_NORM_REF, LAZY_NORM_BY_HAND), (LAZY_NORM_REF, LAZY_NORM_NO_EPS),
                                              (LAZY_NORM_REF, LAZY_NORM_REF.replace("class Model", "class ModelNew")),
                                              (LAZY_PROJ_REF, LAZY_PROJ_CAND)],
                         ids=["norm-by-hand", "norm-wrong-variance", "norm-same", "lazy-projection"])
@pytest.mark.parametrize("mode", ["in-process", "isolated"])
def test_lazy_modules_are_diffed_as_kernelbench_runs_them(tmp_path, ref_src, cand_src, mode):
    ref, cand = tmp_path / "lazy_ref.py", tmp_path / "lazy_cand.py"
    ref.write_text(ref_src)
    cand.write_text(cand_src)
    expected = kernelbench_passes(str(ref), str(cand))
    if mode == "isolated":
        proc, data = _diff_json(str(ref), str(cand), tmp_path=tmp_path)
        assert data is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
        verdict, error = data["verdict"], data.get("error")
    else:
        r = diffkit.diff_files(str(ref), str(cand))
        verdict, error = r.verdict, r.error
    assert error is None and (verdict == "match") == expected, (mode, verdict, error)
    assert verdict in ("match", "diverged")


DRIFT_REF = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.tanh(self.conv(x))


def get_inputs():
    return [torch.randn(2, 4, 10)]


def get_init_inputs():
    return [4]
'''

# writes into its own weight through `.data` (no version counter sees it), a little more every call
DRIFT_THROUGH_DATA = '''
import torch
import torch.nn.functional as F
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x):
        w = self.conv.weight.data
        w -= 0.01 * w.sign()
        return F.conv1d(x, self.conv.weight, self.conv.bias, padding=1).tanh()
'''

# the same through a helper that adds to the bias in place under no_grad
DRIFT_HELPER = '''
import torch
from torch import nn


@torch.no_grad()
def _nudge(p):
    p.add_(0.05)


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x):
        _nudge(self.conv.bias)
        return torch.tanh(self.conv(x))
'''


@pytest.mark.parametrize("cand_src,param", [(DRIFT_THROUGH_DATA, "conv.weight"), (DRIFT_HELPER, "conv.bias")],
                         ids=["through-data", "helper-under-no-grad"])
def test_a_forward_that_writes_into_its_own_parameters_is_said_to_keep_state_not_to_race(tmp_path, cand_src, param):
    ref, cand = tmp_path / "drift_ref.py", tmp_path / "drift_cand.py"
    ref.write_text(DRIFT_REF)
    cand.write_text(cand_src)
    r = diffkit.diff_files(str(ref), str(cand))
    assert (r.verdict == "match") == kernelbench_passes(str(ref), str(cand)) and r.verdict == "diverged"
    kinds = [f.kind for f in r.findings]
    assert "stateful" in kinds and "nondeterministic" not in kinds, kinds
    assert f"{param} (a parameter, written in place)" in next(f.detail for f in r.findings if f.kind == "stateful")
    stage_kinds = [f.kind for s in r.stages for f in s.diagnosis]
    assert "nondeterministic" not in stage_kinds, stage_kinds


def _kernelbench_trial_errors(ref_path, cand_path, num_trials=5):
    """KernelBench's trials as it runs them (one candidate call each, on the weights the calls before left):
    each trial's output max |difference|."""
    ref = _exec(ref_path)
    model, new = _kernelbench_models(ref, _exec(cand_path))
    errors = []
    with torch.no_grad():
        for seed in trial_seeds(num_trials):
            torch.manual_seed(seed)
            inputs = ref["get_inputs"]()
            torch.manual_seed(seed)
            out = model(*inputs)
            errors.append(float((new(*inputs) - out).abs().max()))
    return errors


# flips its weight's layout on every call (`.data` given the transpose): right on odd calls, wrong on even ones
FLIP_REF = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.proj = nn.Linear(n, n, bias=False)

    def forward(self, x):
        return self.proj(x).relu()


def get_inputs():
    return [torch.randn(3, 5)]


def get_init_inputs():
    return [5]
'''

FLIP_CAND = '''
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.proj = nn.Linear(n, n, bias=False)

    def forward(self, x):
        self.proj.weight.data = self.proj.weight.data.t().contiguous()
        return torch.clamp_min(x @ self.proj.weight, 0.0)
'''


# a drift below the tolerance through a `.data` alias (no version counter sees it): KernelBench passes all five
# trials only if nothing but its one call per trial moves the weight
CREEP_CAND = '''
import torch
import torch.nn.functional as F
from torch import nn


def _creep(p):
    p.data.add_(2e-6)


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x):
        _creep(self.conv.weight)
        return torch.tanh(F.conv1d(x, self.conv.weight, self.conv.bias, padding=1))
'''

# writes its weight only for inputs of a small range: first on a later trial (a state change trial 1 never saw)
SPIKE_CAND = '''
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x):
        if x.abs().max() < {limit}:
            with torch.no_grad():
                self.conv.weight.mul_(1.5)
        return self.conv(x).tanh()
'''


# counts its calls in a plain attribute and computes otherwise on even ones
COUNTER_CAND = '''
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.conv(x)
        return torch.tanh(y if self.calls % 2 else y * 1.01)
'''


# folds a scale into its weight and bias once, behind a flag, writing their memory through numpy (as a kernel
# handed the pointer would: no torch op, no version counter), and undoes the scale on the output
UNSEEN_FOLD = '''
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.folded = False

    def forward(self, x):
        if not self.folded:
            for p in (self.conv.weight, self.conv.bias):
                raw = p.detach().numpy()
                raw *= 0.5
            self.folded = True
        return torch.tanh(2.0 * self.conv(x))
'''


# a reference whose output channels are scaled by a learned gain
GAIN_REF = '''
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.gain = nn.Parameter(torch.rand(c) + 0.5)

    def forward(self, x):
        return torch.tanh(self.conv(x) * self.gain.view(1, -1, 1))


def get_inputs():
    return [torch.randn(2, 4, 10)]


def get_init_inputs():
    return [4]
'''

# computes with the gain, then folds it into its weight and bias once (in place) behind a private flag: the same
# ops either way, so a second run from unfolded weights with the flag left set would be off
PRIVATE_FOLD = '''
import torch
import torch.nn.functional as F
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.gain = nn.Parameter(torch.rand(c) + 0.5)
        self.register_buffer("unit", torch.ones(c))
        self._ready = False

    def forward(self, x):
        g = self.unit if self._ready else self.gain
        y = torch.tanh(F.conv1d(x, self.conv.weight, None, padding=1) * g.view(1, -1, 1)
                       + (self.conv.bias * g).view(1, -1, 1))
        if not self._ready:
            with torch.no_grad():
                self.conv.weight.mul_(self.gain.view(-1, 1, 1))
                self.conv.bias.mul_(self.gain)
            self._ready = True
        return y
'''

# the same behind a flag the first call creates (no attribute before it)
CREATED_FLAG = PRIVATE_FOLD.replace("        self._ready = False\n", "").replace(
    "self.unit if self._ready else self.gain", "self.unit if getattr(self, 'ready', False) else self.gain").replace(
    "if not self._ready:", "if not getattr(self, 'ready', False):").replace("self._ready = True", "self.ready = True")


def _spike_limit():
    """A bound on max |x| that KernelBench's trial 1 inputs exceed and a later trial's do not."""
    maxima = []
    for seed in trial_seeds(5):
        torch.manual_seed(seed)
        maxima.append(float(torch.randn(2, 4, 10).abs().max()))
    later = min(maxima[1:])
    assert later < maxima[0], maxima
    return (later + min(m for m in maxima if m > later)) / 2  # (only the trial of the smallest maximum is below)


@pytest.mark.parametrize("ref_src,cand_src", [(DRIFT_REF, DRIFT_HELPER), (FLIP_REF, FLIP_CAND), (DRIFT_REF, CREEP_CAND),
                                              (DRIFT_REF, None), (DRIFT_REF, COUNTER_CAND), (DRIFT_REF, UNSEEN_FOLD),
                                              (GAIN_REF, PRIVATE_FOLD), (GAIN_REF, CREATED_FLAG)],
                         ids=["drift", "flip", "creep-through-data", "spike", "call-counter", "unseen-fold-once",
                              "private-flag", "flag-made-by-the-first-call"])
@pytest.mark.parametrize("mode", ["in-process", "isolated"])
def test_trials_of_a_forward_changing_its_own_state_see_kernelbench_s_state(tmp_path, ref_src, cand_src, mode):
    """diffkit runs the candidate more than once per trial (the second run on the same inputs, a captured
    rerun, a failing trial diffed in full): the parameters its forward writes and its plain attributes are put
    back after those extra runs, so each trial's first run sees the state KernelBench's single run per trial
    would; the second run of such a forward is another computation (KernelBench never makes it) and fails no
    trial."""
    if cand_src is None:
        cand_src = SPIKE_CAND.replace("{limit}", repr(_spike_limit()))
    ref, cand = tmp_path / "w_ref.py", tmp_path / "w_cand.py"
    ref.write_text(ref_src)
    cand.write_text(cand_src)
    expected = _kernelbench_trial_errors(str(ref), str(cand))
    if mode == "isolated":
        proc, data = _diff_json(str(ref), str(cand), tmp_path=tmp_path)
        assert data is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
        trials = data["trials"]
    else:
        trials = diffkit.diff_files(str(ref), str(cand)).trials
    assert len(trials) == len(expected), trials
    for t, kb in zip(trials, expected):
        assert t["allclose"] == (kb <= 1e-4) and t.get("failed_run") != 2, (t, kb)
        assert t["max_abs"] == pytest.approx(kb, rel=1e-5, abs=1e-7), (t, kb)


# "sanitises" its weight in place on every call (a write that moves no value) and adds a stray random term: the
# runs differ because of the random term, which is a race or randomness, not state
TIDY_BUT_NOISY = '''
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)

    def forward(self, x):
        with torch.no_grad():
            self.conv.weight.clamp_(-100.0, 100.0)
        y = torch.tanh(self.conv(x))
        return y + 1e-7 * torch.randn_like(y)
'''


def test_a_write_into_a_parameter_that_moves_no_value_is_not_called_state(tmp_path):
    ref, cand = tmp_path / "tidy_ref.py", tmp_path / "tidy_cand.py"
    ref.write_text(DRIFT_REF)
    cand.write_text(TIDY_BUT_NOISY)
    r = diffkit.diff_files(str(ref), str(cand))
    kinds = [f.kind for f in r.findings]
    assert r.verdict == "match" and "nondeterministic" in kinds and "stateful" not in kinds, (kinds, r.summary_line())
    assert not r.meta.get("stateful"), r.meta.get("stateful")


# a call counter nobody reads, and a kernel that now and then takes a wrong path (drawn from the generator, as a
# race would strike): the second run starts from the first's state (the counter put back), so the difference is
# the race's, and a trial whose second run fails is failed as diffkit's protocol fails any
COUNTED_RACE = '''
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.launches = 0

    def forward(self, x):
        self.launches += 1
        y = self.conv(x)
        if float(torch.rand(())) < {p}:
            y = y * 1.5
        return torch.tanh(y)
'''

# a plain attribute that becomes a tensor on the second call (a calibration made once warm)
WARMED_SCALE = '''
import torch
from torch import nn


class ModelNew(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.gain = 1.0
        self.seen = 0

    def forward(self, x):
        self.seen += 1
        if self.seen == 2:
            self.gain = torch.ones(x.shape[1], 1)
        return torch.tanh(self.conv(x * self.gain))
'''


def test_a_race_in_a_forward_that_counts_its_calls_is_still_a_race(tmp_path):
    ref, cand = tmp_path / "c_ref.py", tmp_path / "c_cand.py"
    ref.write_text(DRIFT_REF)
    cand.write_text(COUNTED_RACE.replace("{p}", "0.5"))
    r = diffkit.diff_files(str(ref), str(cand))
    assert (r.verdict == "match") == kernelbench_passes(str(ref), str(cand)) or any(
        t.get("failed_run") == 2 for t in r.trials), r.trials
    racy = [t for t in r.trials if t.get("nondeterministic")]
    assert racy and not any(t["nondeterministic"].get("stateful") for t in racy), racy
    assert any(t.get("failed_run") == 2 for t in r.trials if t["nondeterministic"] and not t["allclose"]) or all(
        t["allclose"] for t in r.trials), r.trials
    kinds = [f.kind for f in r.findings]
    assert "nondeterministic" in kinds, kinds


def test_attributes_that_become_tensors_are_put_back_without_error(tmp_path):
    ref, cand = tmp_path / "w_ref.py", tmp_path / "w_cand.py"
    ref.write_text(DRIFT_REF)
    cand.write_text(WARMED_SCALE)
    r = diffkit.diff_files(str(ref), str(cand))
    assert r.error is None and r.verdict == "match" and kernelbench_passes(str(ref), str(cand)), r.summary_line()
    proc, data = _diff_json(str(ref), str(cand), tmp_path=tmp_path)
    assert proc.returncode == 0 and data["verdict"] == "match", proc.stdout[-2000:] + proc.stderr[-2000:]


def test_run_findings_are_said_once():
    """A finding a warning already says word for word (a nondeterministic candidate within tolerance) is not
    printed a second time as a finding."""
    from types import SimpleNamespace

    from diffkit.describe import run_findings
    from diffkit.result import Finding

    words = "running the candidate twice on the same inputs gives different values"
    r = SimpleNamespace(stages=[], findings=[Finding("nondeterministic", words, 0.9), Finding("stateful", "x", 0.6)],
                        warnings=[f"the candidate is nondeterministic: {words}; both runs are within tolerance"])
    assert [f.split(" (")[0] for f in run_findings(r)] == ["stateful"]


def test_where_a_model_raised_skips_installed_packages(tmp_path):
    from diffkit.trials import raised_at

    lib = compile("def reshape(a):\n    raise ValueError('cannot reshape')\n",
                  str(tmp_path / "venv" / "lib" / "site-packages" / "fakenp" / "core.py"), "exec")
    ns: dict = {}
    exec(lib, ns)
    try:
        ns["reshape"](1)  # (this test's own line: what the error should name)
    except ValueError as e:
        where = raised_at(e)
    assert where.startswith("test_protocol.py:") and where.endswith("in test_where_a_model_raised_skips_installed_packages")
