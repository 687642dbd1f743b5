"""One pipeline: every surface (in-process, isolated, streaming, two captures, a captured reference
against a candidate file) gives the same answer; the result round-trips through result.json; only
`judge` decides the verdict."""
import json
import os

import pytest
import torch
import torch.nn as nn

import diffkit
from diffkit.options import Options, Tolerance
from diffkit.pipeline import judge
from diffkit.result import Result

from conftest import candidates, diff_once, run_cli, same_pair

BROKEN = [pytest.param(*c, id=c[0], marks=same_pair(c[2])) for c in candidates()
          if c[3] is not None and c[3].get("verdict") != "error"]
_CAPTURED = {}  # reference file -> (the `diffkit capture` run, its capture): a reference is captured once per process


def _answer(data: dict) -> tuple:
    """What must not depend on the surface: verdict, first divergence, root cause, first diagnosis."""
    fd, rc = data["first_divergence"], data["root_cause"]
    return (data["verdict"], fd and fd["ref_name"], rc and rc["ref_name"],
            fd["diagnosis"][0]["kind"] if fd and fd["diagnosis"] else None)


@pytest.mark.slow
@pytest.mark.parametrize("name,ref,cand,exp", BROKEN)
def test_every_surface_gives_the_same_answer(name, ref, cand, exp, ops, tmp_path, tmp_path_factory):
    in_process = _answer(diff_once(ref, cand).to_dict())  # (the Result test_diff and test_rootcause read)
    assert in_process[1] is not None  # (an intermediate may diverge under a passing output: then "match")
    streaming = _answer(diffkit.diff_files(ref, cand, max_memory=1 << 30).to_dict())

    isolated = run_cli("diff", ref, cand, "--json", str(tmp_path / "iso.json"), "--no-report")
    code = {"match": 0, "diverged": 1}[in_process[0]]
    assert isolated.returncode == code, isolated.stdout + isolated.stderr
    if ref not in _CAPTURED:  # (the capture of a reference does not depend on the candidate; a diff only reads it)
        ref_dkt = tmp_path_factory.mktemp("captured-reference") / "ref.dkt"
        _CAPTURED[ref] = run_cli("capture", ref, "-o", str(ref_dkt)), ref_dkt
    ref_capture, ref_dkt = _CAPTURED[ref]
    captures = [ref_capture,
                run_cli("capture", cand, "--side", "cand", "--inputs-from", ref, "-o", str(tmp_path / "cand.dkt"))]
    assert all(p.returncode == 0 for p in captures), [p.stdout[-2000:] + p.stderr[-2000:] for p in captures]
    two = run_cli("diff", str(ref_dkt), str(tmp_path / "cand.dkt"), "--json", str(tmp_path / "two.json"),
                  "--no-report")
    assert two.returncode == code, two.stdout + two.stderr
    against = run_cli("diff", str(ref_dkt), cand, "--json", str(tmp_path / "against.json"), "--no-report")
    assert against.returncode == code, against.stdout + against.stderr

    answers = {"in-process": in_process, "streaming": streaming,
               "isolated": _answer(json.loads((tmp_path / "iso.json").read_text())),
               "two captures": _answer(json.loads((tmp_path / "two.json").read_text())),
               "captured reference": _answer(json.loads((tmp_path / "against.json").read_text()))}
    assert len(set(answers.values())) == 1, answers


def test_result_json_round_trips(ops, tmp_path):
    from conftest import KERNELS, REFS

    result = diffkit.diff_files(os.path.join(REFS, "axial_attention.py"),
                                os.path.join(KERNELS, "axial_attention_missing_bias.py"))
    text = result.to_json()
    back = Result.from_json(text)
    assert back.to_dict() == json.loads(text)
    assert back.verdict == result.verdict == "diverged"
    assert back.first_divergence is back.stages[result.first_divergence.index]
    assert back.first_divergence.stats == result.first_divergence.stats
    assert back.root_cause.local == result.root_cause.local
    assert [f.kind for f in back.first_divergence.diagnosis] == [f.kind for f in result.first_divergence.diagnosis]
    # values are not part of the data: the live result reaches them through its store, the read-back one cannot
    assert result.first_divergence.ref_value is not None and back.first_divergence.ref_value is None
    assert back.summary_line() == result.summary_line()


class _Shift(nn.Module):
    def __init__(self, bug=0.0):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bug = bug

    def forward(self, x):
        return self.lin(x) + self.bug


def _pair(bug):
    torch.manual_seed(0)
    ref, cand = _Shift(), _Shift(bug)
    cand.load_state_dict(ref.state_dict())
    return ref, cand, [torch.randn(3, 4)]


def test_judge_alone_sets_the_verdict():
    ref, cand, x = _pair(0.5)
    result = diffkit.compare(ref, cand, x)
    assert result.verdict == judge(result) == "diverged"
    # the same evidence judged under strict/auto/sanitizer rules, without re-running anything
    ok = diffkit.compare(*_pair(0.0))
    assert judge(ok) == "match"
    ok.meta["sanitizer_errors"] = 2
    assert judge(ok) == "diverged" and "compute-sanitizer" in ok.warnings[0]


def test_auto_tolerance_keeps_stats_and_status_consistent():
    ref, cand, x = _pair(1e-5)
    auto = diffkit.compare(ref, cand, x, tolerance="auto")
    data = auto.to_dict()
    out = next(s for s in data["stages"] if s["cand_name"] == "output")
    assert out["passed"] == (out["status"] == "ok")
    assert data["output"]["passed"] == (data["verdict"] == "match")


def test_options_are_validated():
    with pytest.raises(ValueError):
        Tolerance(atol=float("nan"))
    with pytest.raises(ValueError):
        Tolerance(atol=-1.0)
    with pytest.raises(ValueError):
        Options(max_memory=-5)
    assert Tolerance(atol=1e-3).rtol == 1e-3


def test_cli_rejects_bad_tolerances():
    from conftest import KERNELS, REFS

    for flag in (["--atol", "nan"], ["--atol", "-1"], ["--rtol", "inf"]):
        proc = run_cli("diff", os.path.join(REFS, "tempered_softmax.py"),
                       os.path.join(KERNELS, "tempered_softmax_cpp.py"), *flag, "--no-report")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (flag, proc.stderr[-500:])


def test_may_be_random_only_for_dropout_or_sampling():
    """The reference's second run (its health check) happens only where randomness is possible: a
    deterministic model is not re-run because of the wording of a message."""
    from diffkit.pipeline import may_be_random, run_captured

    class Plain(torch.nn.Module):
        def __init__(self, p=0.0, sample=False):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.drop = torch.nn.Dropout(p)
            self.sample = sample

        def forward(self, x):
            y = self.drop(torch.softmax(self.lin(x), -1))
            return y + torch.rand_like(y) if self.sample else y

    x = torch.randn(2, 4)
    for model, want in ((Plain(), False), (Plain(p=0.3), True), (Plain(sample=True), True)):
        assert may_be_random(model, run_captured(model, [x])) is want
    assert may_be_random(Plain(p=0.3).eval(), run_captured(Plain(p=0.3).eval(), [x])) is False


class _ExpSum(nn.Module):
    def forward(self, x):
        a = x.exp()
        return a.sum(-1)


class _LogSumExpThenExp(nn.Module):
    def forward(self, x):
        return torch.logsumexp(x, -1).exp()


def test_a_reference_stage_right_after_the_inputs_with_no_counterpart_is_listed():
    """The reference's first record after its inputs, unpaired, is a row of its own (it once went
    with the inputs' rows, which are not listed)."""
    res = diffkit.compare(_ExpSum(), _LogSumExpThenExp(), [torch.randn(3, 5)])
    assert res.verdict == "match"
    lone = [s for s in res.stages if s.ref is not None and s.cand is None]
    assert [s.ref.names()[0] for s in lone] == ["forward:a"] and lone[0].status == "unmatched"


def test_the_collector_makes_no_full_pass_while_a_diff_runs_and_as_usual_after():
    import gc

    from diffkit.pipeline import collector_quiet

    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append(gc.get_threshold())
            return x * 2

    before = gc.get_threshold()
    diffkit.compare(Probe(), Probe(), [torch.randn(4, 4)], health=False, rerun=False)
    assert seen and all(t[:2] == before[:2] and t[2] >= 1 << 30 for t in seen)  # young generations as usual
    assert gc.get_threshold() == before  # put back
    gc.disable()
    try:
        with collector_quiet():
            assert gc.get_threshold() == before  # the collector is off: nothing to change
    finally:
        gc.enable()
