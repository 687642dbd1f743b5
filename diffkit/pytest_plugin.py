"""The pytest plugin (entry point ``pytest11``): a ``diffkit`` fixture for comparing models in tests.

    def test_kernel(diffkit):
        diffkit.compare(Model(), ModelNew(), [torch.randn(8, 512)])   # or file paths: ("ref.py", "cand.py")

``compare`` runs diffkit's comparison in the test's process, writes the report to
``--diffkit-report-dir/<test id>/`` (default ``reports/pytest``), records the report's path as the JUnit
property ``diffkit_report`` and, when the candidate does not match, fails the test with the first
divergence (the message of `diffkit.testing.assert_models_close`) and the report's path.  It returns
the `Result` when the candidate matches.  With ``harden=True`` (``diffkit.compare("ref.py", "cand.py",
harden=True)``) a candidate that matches but breaks under a ``--harden`` setting fails the test too, with a
line per breaking setting.

This module is loaded by every pytest run where diffkit is installed: it imports nothing heavy itself
(torch and diffkit's internals are imported when ``compare`` is first called).
"""
from __future__ import annotations

import os
import re
from typing import Any, Sequence

import pytest

DEFAULT_REPORT_DIR = os.path.join("reports", "pytest")
PROPERTY = "diffkit_report"
_REPORTS = pytest.StashKey[list]()  # every report the fixture wrote in this session


def pytest_addoption(parser) -> None:
    group = parser.getgroup("diffkit", "diffkit: stage-by-stage model comparison")
    group.addoption("--diffkit-report-dir", dest="diffkit_report_dir", default=None, metavar="DIR",
                    help=f"where the diffkit fixture writes its reports, one folder per test "
                         f"(default: {DEFAULT_REPORT_DIR}, relative to the directory pytest was started in)")


def report_root(config) -> str:
    root = config.getoption("diffkit_report_dir", default=None) or DEFAULT_REPORT_DIR
    if not os.path.isabs(root):
        root = os.path.join(str(config.invocation_params.dir), root)
    return root


def sanitise(nodeid: str, limit: int = 150) -> str:
    """A test id as a folder name: ``tests/test_k.py::test_a[x-1]`` -> ``tests_test_k.py__test_a_x-1``."""
    name = re.sub(r"[^0-9A-Za-z_.-]+", "_", nodeid.replace("::", "__")).strip("._-") or "test"
    return name if len(name) <= limit else name[:limit].rstrip("._-")


class DiffkitFixture:
    """What the ``diffkit`` fixture gives a test: ``compare`` and the reports it wrote."""

    def __init__(self, nodeid: str, root: str, record_property):
        self.nodeid, self.root, self._record = nodeid, root, record_property
        self.reports: list[str] = []

    def report_dir(self) -> str:
        """This test's report folder (a suffix for the second comparison of the same test on)."""
        base = os.path.join(self.root, sanitise(self.nodeid))
        return base if not self.reports else f"{base}-{len(self.reports) + 1}"

    def compare(self, ref: Any, cand: Any, inputs: Sequence[Any] | None = None, atol: float | None = None,
                rtol: float | None = None, *, report: bool = True, **settings):
        """Compare `cand` with `ref` (nn.Module instances with `inputs`, or KernelBench file paths);
        fail the test unless the candidate matches (and, with harden=True, no setting breaks it), else return
        the Result.  Other keywords are diffkit `Options` (strict=True, tolerance="auto", trials=…, harden=True)."""
        from .describe import assertion_message

        if isinstance(ref, (str, os.PathLike)) or isinstance(cand, (str, os.PathLike)):
            if not (isinstance(ref, (str, os.PathLike)) and isinstance(cand, (str, os.PathLike))):
                raise TypeError("diffkit.compare: give two models or two file paths")
            if inputs is not None:
                raise TypeError("diffkit.compare: files bring their own inputs (get_inputs()); drop `inputs`")
            from .compare import diff_files, error_result
            from .errors import DiffkitError
            from .options import Options

            try:
                result = diff_files(os.fspath(ref), os.fspath(cand), atol=atol, rtol=rtol, **settings)
            except DiffkitError as e:  # a file that does not load or build: an answer, with a report
                result = error_result(e, os.fspath(ref), os.fspath(cand), Options.build(atol=atol, rtol=rtol))
        else:
            if inputs is None:
                raise TypeError("diffkit.compare: give the inputs (a list) for the two models")
            from .compare import compare

            result = compare(ref, cand, list(inputs), atol, rtol, **settings)
        where = ""
        if report:
            from .report import write_report

            directory = self.report_dir()
            paths = write_report(result, directory)
            self.reports.append(paths["html"])
            self._record(PROPERTY, paths["html"])
            where = paths["html"]
        if result.verdict == "match" and not _breaks(result):
            return result
        message = assertion_message(result) if result.verdict != "match" else _harden_message(result)
        pytest.fail(message + (f"\ndiffkit report: {where}" if where else ""), pytrace=False)


def _breaks(result) -> bool:
    """`harden=True` and a setting breaks the candidate: the test fails, as for a divergence."""
    h = getattr(result, "harden", None)
    return h is not None and h.verdict == "breaks"


def _harden_message(result) -> str:
    """Why a candidate KernelBench's verdict passes fails the test under `harden=True`: the diff's --harden line,
    then each setting that breaks it, in a line."""
    from .describe import harden_summary
    from .render import harden_setting_line

    return "\n".join([harden_summary(result)] + [f"  {harden_setting_line(s)}" for s in result.harden.breaking])


@pytest.fixture
def diffkit(request, record_property) -> DiffkitFixture:
    """``diffkit.compare(ref, cand, inputs)``: fail the test at the first diverging stage, with a report."""
    fixture = DiffkitFixture(request.node.nodeid, report_root(request.config), record_property)
    yield fixture
    if fixture.reports:
        request.config.stash.setdefault(_REPORTS, []).extend(fixture.reports)



def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    reports = config.stash.get(_REPORTS, [])
    if reports:
        terminalreporter.write_sep("-", "diffkit reports")
        terminalreporter.write_line(f"{len(reports)} written under {report_root(config)}")
