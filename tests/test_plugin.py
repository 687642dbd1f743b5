"""The pytest plugin: the `diffkit` fixture fails a test at the first divergence, with the report
written and its path recorded as a JUnit property (checked with pytester)."""
import ast
import importlib.metadata
import os
import xml.etree.ElementTree as ET

from conftest import KERNELS, REFS

pytest_plugins = ["pytester"]

TESTS = '''
import pytest
import torch
import torch.nn as nn


class Ref(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 4)

    def forward(self, x):
        return torch.relu(self.proj(x))


class NoBias(Ref):
    def forward(self, x):
        return torch.relu(x @ self.proj.weight.t())


def test_matching(diffkit):
    result = diffkit.compare(Ref(), Ref(), [torch.randn(3, 8)])
    assert result.verdict == "match"


def test_diverging(diffkit):
    diffkit.compare(Ref(), NoBias(), [torch.randn(3, 8)])


def test_files(diffkit):
    result = diffkit.compare({ref!r}, {cand!r}, trials=2)
    assert result.verdict == "match"
'''


def test_plugin_is_loaded_through_its_entry_point(pytestconfig):
    import diffkit.pytest_plugin

    assert pytestconfig.pluginmanager.get_plugin("diffkit") is diffkit.pytest_plugin  # the pytest11 entry point's name
    # (a stale diffkit.egg-info in the source tree may sit beside the installed metadata: look at every copy)
    declared = {(ep.name, ep.value) for d in importlib.metadata.distributions() if d.metadata["Name"] == "diffkit"
                for ep in d.entry_points if ep.group == "pytest11"}
    assert declared == {("diffkit", "diffkit.pytest_plugin")}


def test_plugin_module_imports_nothing_heavy_at_load():
    """Loaded by every pytest run: torch and diffkit's internals only inside the fixture."""
    import diffkit.pytest_plugin as plugin

    tree = ast.parse(open(plugin.__file__, encoding="utf-8").read())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top for a in n.names} | {n.module for n in top if isinstance(n, ast.ImportFrom)}
    assert names <= {"__future__", "annotations", "os", "re", "typing", "Any", "Sequence", "pytest"}, names


def test_fixture_fails_a_diverging_candidate(pytester):
    pytester.makepyfile(test_models=TESTS.format(ref=os.path.join(REFS, "row_softmax.py"),
                                                 cand=os.path.join(KERNELS, "row_softmax_fused.py")))
    reports = pytester.path / "out"
    junit = pytester.path / "junit.xml"
    result = pytester.runpytest("--diffkit-report-dir", str(reports), f"--junitxml={junit}", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*diffkit: DIVERGED at stage * proj*",
                                 "*First diverging stage*",
                                 f"*diffkit report: {reports}*test_models.py__test_diverging*index.html*"])
    for test in ("test_matching", "test_diverging", "test_files"):
        assert (reports / f"test_models.py__{test}" / "index.html").is_file(), test
        assert (reports / f"test_models.py__{test}" / "result.json").is_file(), test
    root = ET.parse(junit).getroot()
    props = {case.get("name"): [(p.get("name"), p.get("value")) for p in case.iter("property")]
             for case in root.iter("testcase")}
    for test in ("test_matching", "test_diverging", "test_files"):
        assert props[test] == [("diffkit_report", str(reports / f"test_models.py__{test}" / "index.html"))]
    failure = next(c for c in root.iter("testcase") if c.get("name") == "test_diverging").find("failure")
    assert "DIVERGED" in failure.get("message")


def test_default_report_dir_and_second_comparison(pytester):
    pytester.makepyfile(test_twice='''
import torch


def test_twice(diffkit):
    m = torch.nn.Identity()
    diffkit.compare(m, m, [torch.ones(2)])
    diffkit.compare(m, m, [torch.ones(2)])
    assert len(diffkit.reports) == 2
''')
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    base = pytester.path / "reports" / "pytest" / "test_twice.py__test_twice"
    assert (base / "index.html").is_file() and (base.parent / (base.name + "-2") / "index.html").is_file()
    result.stdout.fnmatch_lines(["*diffkit reports*", "2 written under *"])
