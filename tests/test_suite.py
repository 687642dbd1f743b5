"""`diffkit suite`: discovery, the same verdicts as one-by-one diffs, the summary files, resume,
interruption and exit codes.  Pure-PyTorch pairs only (no extension builds), so it stays quick on
two cores."""
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import junitparser
import pytest

from conftest import KERNELS, REFS, ROOT, candidates

from diffkit.result import Result
from diffkit.suite import (SuiteEntry, discover, discover_folders, discover_kernelbench, exit_code, index_html,
                           summary_csv, summary_json)

PY = [sys.executable, "-m", "diffkit.cli"]
OPTS = ["--trials", "2"]  # the same options for the suite and for the one-by-one diffs

TINY_REF = '''import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=1)


def get_inputs():
    return [torch.randn(4, 16)]


def get_init_inputs():
    return []
'''
TINY_CAND = '''import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        e = torch.exp(x - x.max(dim=1, keepdim=True).values)
        return {scale}e / e.sum(dim=1, keepdim=True)
'''
MATCHING = TINY_CAND.format(scale="")
SCALED = TINY_CAND.format(scale="2.0 * ")
SYNTAX_ERROR = "import torch\n\n\nclass ModelNew(torch.nn.Module:\n    pass\n"
SLOW = '''import time

import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        time.sleep(300)
        return x
'''


def _problem(root, name, ref_text=None, cand_text=None, ref=None, cand=None):
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    for target, text, src in (("ref.py", ref_text, ref), ("cand.py", cand_text, cand)):
        if src is not None:
            shutil.copy(src, os.path.join(d, target))
        elif text is not None:
            with open(os.path.join(d, target), "w") as fh:
                fh.write(text)
    return d


def _suite(*args, cwd=ROOT):
    return subprocess.run([*PY, "suite", *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def _read(path):
    with open(path, encoding="utf-8") as fh:
        return fh.read()


# ----------------------------------------------------------------------------- a suite against one-by-one diffs
@pytest.fixture(scope="module")
def bundled(tmp_path_factory):
    """Bundled pairs in folder-per-problem form: two that match, two that diverge, one that errors."""
    root = str(tmp_path_factory.mktemp("problems"))
    _problem(root, "conv_tanh_pool_fused", ref=os.path.join(REFS, "conv_tanh_pool.py"),
             cand=os.path.join(KERNELS, "conv_tanh_pool_fused.py"))
    _problem(root, "row_softmax_fused", ref=os.path.join(REFS, "row_softmax.py"),
             cand=os.path.join(KERNELS, "row_softmax_fused.py"))
    _problem(root, "gelu_tail_fast_path", ref=os.path.join(REFS, "gelu.py"),
             cand=os.path.join(KERNELS, "gelu_tail_fast_path.py"))  # fails on trial 2
    _problem(root, "row_softmax_scaled", ref=os.path.join(REFS, "row_softmax.py"), cand_text=SCALED)
    _problem(root, "syntax_error", ref=os.path.join(REFS, "row_softmax.py"), cand_text=SYNTAX_ERROR)
    return root


@pytest.fixture(scope="module")
def suite_run(bundled, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("suite-out"))
    proc = _suite(bundled, "--report-dir", out, "--workers", "2", *OPTS)
    return proc, out


@pytest.fixture(scope="module")
def one_by_one(bundled, tmp_path_factory):
    """`diffkit diff` on each pair alone (two at a time), with the suite's options: name -> (exit code, Result)."""
    out = str(tmp_path_factory.mktemp("one-by-one"))
    names = sorted(os.listdir(bundled))
    procs, results = {}, {}
    for i in range(0, len(names), 2):
        for name in names[i:i + 2]:
            d = os.path.join(bundled, name)
            procs[name] = subprocess.Popen([*PY, "diff", os.path.join(d, "ref.py"), os.path.join(d, "cand.py"), *OPTS,
                                            "--no-report", "--json", os.path.join(out, f"{name}.json")], cwd=ROOT,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name in names[i:i + 2]:
            code = procs[name].wait(timeout=600)
            results[name] = (code, Result.from_json(_read(os.path.join(out, f"{name}.json"))))
    return results


def test_suite_gives_the_verdicts_of_one_by_one_diffs(suite_run, one_by_one):
    from diffkit.describe import headline, stage_names

    proc, out = suite_run
    summary = json.loads(_read(os.path.join(out, "summary.json")))
    by_name = {row["name"]: row for row in summary}
    assert set(by_name) == set(one_by_one)
    verdicts = {name: row["verdict"] for name, row in by_name.items()}
    assert verdicts == {"conv_tanh_pool_fused": "match", "row_softmax_fused": "match",
                        "gelu_tail_fast_path": "diverged", "row_softmax_scaled": "diverged", "syntax_error": "error"}
    for name, (code, result) in one_by_one.items():
        row = by_name[name]
        assert row["verdict"] == result.verdict, name
        assert code == {"match": 0, "diverged": 1, "error": 2}[result.verdict]
        fd, rc = result.first_divergence, result.root_cause
        assert row["first_divergence"] == (f"stage {fd.index} {stage_names(fd)}" if fd else None), name
        assert row["root_cause"] == (f"stage {rc.index} {stage_names(rc)}" if rc else None), name
        assert row["headline"] == headline(result), name
        # the pair's own result.json is the one-by-one answer
        own = Result.from_json(_read(os.path.join(out, name, "result.json")))
        assert own.verdict == result.verdict and headline(own) == headline(result)
    assert "scale" == by_name["row_softmax_scaled"]["diagnosis"]
    assert "syntax" in by_name["syntax_error"]["error"]
    assert proc.returncode == 2, proc.stdout + proc.stderr  # one errored


def test_summary_files_are_valid_and_agree(suite_run):
    proc, out = suite_run
    summary = json.loads(_read(os.path.join(out, "summary.json")))
    assert isinstance(summary, list) and len(summary) == 5
    for row in summary:
        assert {"name", "verdict", "first_divergence", "root_cause", "report"} <= set(row)
        assert row["report"] == f"{row['name']}/index.html"
        assert os.path.isfile(os.path.join(out, row["report"]))
        marker = json.loads(_read(os.path.join(out, row["name"], "suite.json")))
        assert marker["entry"]["verdict"] == row["verdict"]
    by_name = {row["name"]: row for row in summary}

    rows = list(csv.DictReader(open(os.path.join(out, "summary.csv"), encoding="utf-8", newline="")))
    assert [r["name"] for r in rows] == [row["name"] for row in summary]
    for r in rows:
        assert r["verdict"] == by_name[r["name"]]["verdict"]
        assert r["first_divergence"] == (by_name[r["name"]]["first_divergence"] or "")
        assert float(r["seconds"]) > 0

    xml = junitparser.JUnitXml.fromfile(os.path.join(out, "junit.xml"))
    cases = {c.name: c for s in xml for c in s}
    assert set(cases) == set(by_name)
    for name, case in cases.items():
        kinds = {type(r).__name__ for r in case.result}
        expected = {"match": set(), "diverged": {"Failure"}, "error": {"Error"}}[by_name[name]["verdict"]]
        assert kinds == expected, name
        for r in case.result:
            assert r.message == (by_name[name]["headline"] if by_name[name]["verdict"] == "diverged"
                                 else by_name[name]["error"])
    suite = next(iter(xml))
    assert (suite.tests, suite.failures, suite.errors) == (5, 2, 1)
    tree = _read(os.path.join(out, "junit.xml"))
    for name in by_name:
        assert f'<property name="diffkit_report" value="{name}/index.html" />' in tree

    md = _read(os.path.join(out, "summary.md"))
    assert md.startswith("## diffkit suite: 2 match, 2 diverged, 1 error (5 pairs)")
    assert sum(1 for line in md.splitlines() if line.startswith("| ") and "<code>" in line) == 5

    html = _read(os.path.join(out, "index.html"))
    for name in by_name:
        assert f'<a href="{name}/index.html">{name}</a>' in html
    assert "2 diverged" in html and "1 error" in html


# ----------------------------------------------------------------------------- discovery
def test_folder_discovery(tmp_path):
    root = str(tmp_path)
    _problem(root, "p10", TINY_REF, MATCHING)
    _problem(root, "p2", TINY_REF, MATCHING)
    _problem(root, "no_cand", TINY_REF)
    _problem(root, "no_ref", None, MATCHING)
    os.makedirs(os.path.join(root, "reports"))  # not a problem folder: ignored
    entries = discover_folders([root])
    assert [e.name for e in entries] == ["no_cand", "no_ref", "p2", "p10"]
    errors = {e.name: e.error for e in entries if e.verdict == "error"}
    assert "no cand.py" in errors["no_cand"] and "no ref.py" in errors["no_ref"]
    assert all(e.runnable for e in entries if e.name.startswith("p"))
    # a problem folder given itself is one pair
    assert [(e.name, e.runnable) for e in discover_folders([os.path.join(root, "p2")])] == [("p2", True)]


def test_kernelbench_naming(tmp_path):
    refs, cands = tmp_path / "refs", tmp_path / "cands"
    refs.mkdir()
    cands.mkdir()
    for name in ("28_BMM_InstanceNorm_Sum.py", "5_a.py", "5_b.py", "7_Conv.py"):
        (refs / name).write_text(TINY_REF)
    for name in ("level_2_problem_28_sample_0_kernel.py", "level_2_problem_28_sample_1_kernel.py",
                 "level_2_problem_5_sample_0_kernel.py", "level_2_problem_99_sample_0_kernel.py",
                 "level_2_problem_7_sample_0_kernel.py"):
        (cands / name).write_text(MATCHING)
    (cands / "helpers.py").write_text("X = 1\n")  # defines no ModelNew: not a candidate
    (cands / "mystery_kernel.py").write_text(MATCHING)  # a candidate no reference is named after
    entries = {e.name: e for e in discover_kernelbench(str(refs), str(cands))}
    assert sorted(entries) == sorted(["level_2_problem_5_sample_0", "level_2_problem_7_sample_0",
                                      "level_2_problem_28_sample_0", "level_2_problem_28_sample_1",
                                      "level_2_problem_99_sample_0", "mystery_kernel"])
    for sample in (0, 1):
        e = entries[f"level_2_problem_28_sample_{sample}"]
        assert e.runnable and os.path.basename(e.ref) == "28_BMM_InstanceNorm_Sum.py"
    assert "ambiguous" in entries["level_2_problem_5_sample_0"].error
    assert "5_a.py" in entries["level_2_problem_5_sample_0"].error
    assert "no 99_*.py" in entries["level_2_problem_99_sample_0"].error
    assert "no reference" in entries["mystery_kernel"].error
    assert all(e.verdict == "error" for n, e in entries.items() if not e.runnable)

    # KernelBench's own tree: references under level<L>/
    (refs / "level1").mkdir()
    (refs / "level1" / "28_Other.py").write_text(TINY_REF)
    (cands / "level_1_problem_28_sample_0_kernel.py").write_text(MATCHING)
    e = {x.name: x for x in discover_kernelbench(str(refs), str(cands))}["level_1_problem_28_sample_0"]
    assert e.ref == os.path.join(str(refs), "level1", "28_Other.py")


def test_bundled_candidates_pair_with_their_references():
    """--refs references --cands kernels pairs each bundled candidate with the reference the tests use."""
    entries = {e.name: e for e in discover(refs=REFS, cands=KERNELS)}
    for device in ("cpu", "cuda"):
        for name, ref, cand, _ in candidates(device):
            if not os.path.exists(ref):
                continue
            e = entries[os.path.splitext(name)[0]]
            assert (e.ref, e.cand) == (ref, cand), name
    assert "cpu_ops" not in entries and "_ipa_body" not in entries


def test_kernelbench_suite_runs_and_reports_unpaired(tmp_path):
    refs, cands, out = tmp_path / "refs", tmp_path / "cands", tmp_path / "out"
    refs.mkdir()
    cands.mkdir()
    (refs / "3_Softmax.py").write_text(TINY_REF)
    (cands / "level_1_problem_3_sample_0_kernel.py").write_text(MATCHING)
    (cands / "level_1_problem_3_sample_1_kernel.py").write_text(SCALED)
    (cands / "level_1_problem_4_sample_0_kernel.py").write_text(MATCHING)
    proc = _suite("--refs", str(refs), "--cands", str(cands), "--report-dir", str(out), "--trials", "1",
                  "--no-isolate", "--workers", "2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    rows = {r["name"]: r for r in json.loads((out / "summary.json").read_text())}
    assert {n: r["verdict"] for n, r in rows.items()} == {
        "level_1_problem_3_sample_0": "match", "level_1_problem_3_sample_1": "diverged",
        "level_1_problem_4_sample_0": "error"}
    assert "no reference" in rows["level_1_problem_4_sample_0"]["error"]
    assert rows["level_1_problem_4_sample_0"]["report"] is None


# ----------------------------------------------------------------------------- exit codes, resume, interruption
def test_exit_code_zero_when_all_match(tmp_path):
    _problem(str(tmp_path / "in"), "a", TINY_REF, MATCHING)
    _problem(str(tmp_path / "in"), "b", TINY_REF, MATCHING)
    proc = _suite(str(tmp_path / "in"), "--report-dir", str(tmp_path / "out"), "--trials", "1", "--no-isolate",
                  "--workers", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 match, 0 diverged, 0 error" in proc.stdout


def test_resume_skips_finished_pairs(tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _problem(src, "a_match", TINY_REF, MATCHING)
    _problem(src, "b_scaled", TINY_REF, SCALED)
    args = [src, "--report-dir", out, "--trials", "1", "--no-isolate", "--workers", "2"]
    first = _suite(*args)
    assert first.returncode == 1, first.stdout + first.stderr  # one diverged, none errored

    def stamps():
        return {n: os.stat(os.path.join(out, n, "result.json")).st_mtime_ns for n in ("a_match", "b_scaled")}

    before, summary = stamps(), json.loads(_read(os.path.join(out, "summary.json")))
    again = _suite(*args, "--resume")
    assert again.returncode == 1
    assert stamps() == before
    assert again.stdout.count("resumed") == 2
    assert json.loads(_read(os.path.join(out, "summary.json"))) == summary

    # a changed candidate is run again, the other pair is not
    with open(os.path.join(src, "b_scaled", "cand.py"), "w") as fh:
        fh.write(MATCHING)
    third = _suite(*args, "--resume")
    assert third.returncode == 0, third.stdout + third.stderr
    after = stamps()
    assert after["a_match"] == before["a_match"] and after["b_scaled"] != before["b_scaled"]
    assert {r["name"]: r["verdict"] for r in json.loads(_read(os.path.join(out, "summary.json")))} == {
        "a_match": "match", "b_scaled": "match"}
    # other diff options: nothing is taken from the earlier run
    fourth = _suite(*args, "--resume", "--atol", "1e-3")
    assert fourth.returncode == 0 and "resumed" not in fourth.stdout


def test_interrupted_suite_keeps_its_summaries_and_resumes(tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _problem(src, "a_fast", TINY_REF, MATCHING)
    _problem(src, "b_slow", TINY_REF, SLOW)
    proc = subprocess.Popen([*PY, "suite", src, "--report-dir", out, "--trials", "1", "--no-isolate"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = os.path.join(out, "b_slow", "diff.log")
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(log) and os.path.exists(os.path.join(out, "a_fast",
                                                                                               "suite.json"))):
        time.sleep(0.2)
    time.sleep(3)  # b_slow's child is in its forward now
    proc.send_signal(signal.SIGINT)
    start = time.time()
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 128 + signal.SIGINT, output
    assert time.time() - start < 30  # the child was stopped, not waited for
    rows = json.loads(_read(os.path.join(out, "summary.json")))
    assert [(r["name"], r["verdict"]) for r in rows] == [("a_fast", "match")]
    xml = junitparser.JUnitXml.fromfile(os.path.join(out, "junit.xml"))
    kinds = {c.name: {type(r).__name__ for r in c.result} for s in xml for c in s}
    assert kinds == {"a_fast": set(), "b_slow": {"Skipped"}}
    assert "interrupted by SIGINT" in _read(os.path.join(out, "index.html"))
    assert not os.path.exists(os.path.join(out, "b_slow", "suite.json"))

    with open(os.path.join(src, "b_slow", "cand.py"), "w") as fh:
        fh.write(SCALED)
    resumed = _suite(src, "--report-dir", out, "--trials", "1", "--no-isolate", "--resume")
    assert resumed.returncode == 1, resumed.stdout + resumed.stderr
    assert "a_fast: resumed: match" in resumed.stdout and "b_slow: diverged" in resumed.stdout


def test_a_killed_child_is_an_error_entry_and_the_others_keep_their_answers(tmp_path):
    src, out = str(tmp_path / "in"), str(tmp_path / "out")
    _problem(src, "a_match", TINY_REF, MATCHING)
    killed = "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\nclass ModelNew: pass\n"
    _problem(src, "b_killed", TINY_REF, killed)
    proc = _suite(src, "--report-dir", out, "--trials", "1", "--no-isolate")
    assert proc.returncode == 2
    rows = {r["name"]: r for r in json.loads(_read(os.path.join(out, "summary.json")))}
    assert rows["a_match"]["verdict"] == "match"
    assert rows["b_killed"]["verdict"] == "error" and "SIGKILL" in rows["b_killed"]["error"]


# ----------------------------------------------------------------------------- the writers alone
def test_writers_escape_names_and_messages():
    entries = [SuiteEntry("=HYPERLINK(\"x\")", "r.py", "c.py", verdict="diverged", first_divergence="+stage 1 <b>",
                          report="x/index.html", headline="-bad", seconds=1.0),
               SuiteEntry("<script>alert(1)</script>", None, "c.py", verdict="error", error="<img src=x onerror=1>",
                          headline="diffkit: ERROR")]
    rows = list(csv.reader(summary_csv(entries).splitlines()))
    assert rows[1][0] == "'=HYPERLINK(\"x\")" and rows[1][2] == "'+stage 1 <b>" and rows[1][8] == "'-bad"
    html = index_html(entries)
    assert "<script>alert" not in html and "&lt;script&gt;" in html and "<img src=x" not in html
    assert json.loads(summary_json(entries))[1]["report"] is None
    assert exit_code(entries) == 2 and exit_code(entries[:1]) == 1 and exit_code([]) == 0


def test_diff_options_are_passed_through():
    from diffkit.suite import diff_argv, suite

    ctx = suite.make_context("suite", ["d", "--no-isolate", "--eval", "--trials", "2", "--atol", "1e-3", "--device",
                                       "cpu", "--workers", "3", "--resume"])
    assert diff_argv(ctx, ctx.params) == ["--atol", "0.001", "--trials", "2", "--eval", "--device", "cpu",
                                          "--no-isolate"]
    ctx = suite.make_context("suite", ["d"])
    assert diff_argv(ctx, ctx.params) == []  # defaults are left to `diff`
