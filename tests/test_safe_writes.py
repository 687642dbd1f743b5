"""Files diffkit writes into a folder someone else can write to (issue 45): a symbolic link planted at the name of
a report file, a suite summary or a pair's log is replaced, never written through; the file it points at keeps
its bytes."""
import json
import os

import pytest

from diffkit.safefiles import open_fresh, write_text

from conftest import REFS, run_cli

REPORT_FILES = ["index.html", "result.json", "stages.csv", "summary.md", "junit.xml"]
SUITE_FILES = ["index.html", "summary.json", "summary.csv", "junit.xml", "summary.md"]


def _victim(tmp_path):
    v = tmp_path / "victim.txt"
    v.write_text("precious")
    return v


def test_write_text_replaces_a_link_and_leaves_its_target(tmp_path):
    victim = _victim(tmp_path)
    link = tmp_path / "out" / "f.txt"
    link.parent.mkdir()
    os.symlink(victim, link)
    write_text(str(link), "new")
    assert victim.read_text() == "precious" and not link.is_symlink() and link.read_text() == "new"
    hard = tmp_path / "out" / "h.txt"
    os.link(victim, hard)  # a hard link to the victim: replaced as a name, the victim's bytes stay
    write_text(str(hard), "other")
    assert victim.read_text() == "precious" and hard.read_text() == "other"
    assert sorted(p.name for p in link.parent.iterdir()) == ["f.txt", "h.txt"]  # (no temporary file left)


def test_open_fresh_never_follows_a_link(tmp_path):
    victim = _victim(tmp_path)
    log = tmp_path / "diff.log"
    os.symlink(victim, log)
    with open_fresh(str(log)) as fh:
        fh.write("log line\n")
    assert victim.read_text() == "precious" and log.read_text() == "log line\n" and not log.is_symlink()


def _pair(tmp_path):
    ref = tmp_path / "ref.py"
    ref.write_text(open(os.path.join(REFS, "gelu.py"), encoding="utf-8").read())
    cand = tmp_path / "cand.py"
    cand.write_text(ref.read_text().replace("class Model(", "class ModelNew("))
    return ref, cand


@pytest.mark.parametrize("name", REPORT_FILES + ["--json", "--csv", "--html", "--markdown", "--junit"])
def test_a_link_planted_in_the_report_folder_is_not_written_through(tmp_path, name):
    victim = _victim(tmp_path)
    ref, cand = _pair(tmp_path)
    rd = tmp_path / "rep"
    rd.mkdir()
    if name.startswith("--"):
        target = tmp_path / f"single{name[2:]}"
        os.symlink(victim, target)
        args = [name, target, "--no-report"]
    else:
        target = rd / name
        os.symlink(victim, target)
        args = ["--report-dir", rd]
    proc = run_cli("diff", ref, cand, "--trials", "1", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert victim.read_text() == "precious"
    assert not target.is_symlink() and target.stat().st_size > 0


def test_links_planted_in_a_suite_folder_are_not_written_through(tmp_path):
    victim = _victim(tmp_path)
    problems = tmp_path / "problems" / "p1"
    problems.mkdir(parents=True)
    ref, cand = _pair(tmp_path)
    os.replace(ref, problems / "ref.py")
    os.replace(cand, problems / "cand.py")
    out = tmp_path / "suite"
    (out / "p1").mkdir(parents=True)
    planted = [out / n for n in SUITE_FILES] + [out / "p1" / n for n in ("diff.log", "result.json", "index.html")]
    for p in planted:
        os.symlink(victim, p)
    proc = run_cli("suite", tmp_path / "problems", "--report-dir", out, "--trials", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]
    assert victim.read_text() == "precious"
    for p in planted:
        assert not p.is_symlink(), p
    assert json.loads((out / "summary.json").read_text())[0]["verdict"] == "match"
