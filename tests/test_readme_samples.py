"""The README's samples are what the tool prints today (issue 45): the demo's first-divergence block and headline,
and the `--harden` lines, each checked line by line against a fresh run of the command the README gives (paths
printed under the repository are read relative to it, as the README writes them; `…` stands for text left out)."""
import os
import re

import pytest

from conftest import ROOT, run_cli

README = os.path.join(ROOT, "README.md")


def _block(after: str) -> list[str]:
    """The indented sample lines of the README after the line starting with `after` (up to the next prose)."""
    lines = open(README, encoding="utf-8").read().splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(after))
    out = []
    for ln in lines[i + 1:]:
        if ln.startswith("    "):
            out.append(ln[4:])
        elif ln.strip() or out:
            if out and not ln.strip():
                continue
            if out:
                break
    return out


def _matches(sample: str, printed: list[str]) -> bool:
    pattern = ".*".join(re.escape(part) for part in sample.strip().split("…"))
    return any(re.fullmatch(pattern, ln.strip()) for ln in printed)


def _printed(*args) -> list[str]:
    proc = run_cli(*args, "--no-report")
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout.replace(ROOT + os.sep, "").splitlines()


def test_the_demo_sample_is_what_the_demo_prints():
    sample = _block("## What it prints")
    assert len(sample) >= 5 and sample[0].startswith("first divergence")
    printed = _printed("diff", "references/axial_attention.py", "kernels/axial_attention_missing_bias.py")
    missing = [s for s in sample if not _matches(s, printed)]
    assert not missing, "README lines the demo no longer prints:\n" + "\n".join(missing)


@pytest.mark.parametrize("cand,ref", [("kernels/harden/conv3d_groupnorm_bias_mean.py", "hk_conv3d_groupnorm_mean.py"),
                                      ("kernels/harden/cls_token_params_only.py", "hk_cls_token_encoder.py")])
def test_the_harden_samples_are_what_harden_prints(cand, ref):
    text = open(README, encoding="utf-8").read()
    samples = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("diffkit --harden:")]
    printed = [ln for ln in _printed("diff", f"references/{ref}", cand, "--harden") if ln.startswith("diffkit --harden")]
    assert printed
    # (the seconds it took vary from run to run: the sample's figure stands for any)
    norm = [re.sub(r"\(\d+(\.\d+)? s\)", "(… s)", ln) for ln in printed]
    assert any(re.sub(r"\(\d+(\.\d+)? s\)", "(… s)", s) in norm for s in samples), (samples, printed)


def _code(after: str, first_line: str) -> str:
    """The ```python block of the README section `after` whose first line is `first_line` (without that line)."""
    text = open(README, encoding="utf-8").read()
    section = text.split(after, 1)[1]
    m = re.search(r"```python\n" + re.escape(first_line) + r"\n(.*?)```", section, flags=re.S)
    assert m, f"no ```python block starting {first_line!r} after {after!r}"
    return m.group(1)


def test_the_own_files_sample_is_what_diffkit_prints_for_them(tmp_path):
    """"Your own files": the two files written as the README shows them, the command it gives run in their folder,
    and its sample lines found in what that prints (the files' full paths stand where the sample writes `…`)."""
    head = "## Your own files"
    (tmp_path / "ref.py").write_text(_code(head, "# ref.py"), encoding="utf-8")
    (tmp_path / "cand.py").write_text(_code(head, "# cand.py"), encoding="utf-8")
    text = open(README, encoding="utf-8").read().split(head, 1)[1]
    command = next(ln.strip() for ln in text.splitlines() if ln.strip().startswith("diffkit diff "))
    assert command == "diffkit diff ref.py cand.py"
    sample = _block("Its answer ends with")
    assert len(sample) >= 4 and sample[0].startswith("first divergence") and sample[-1].startswith("diffkit: DIVERGED")
    proc = run_cli(*command.split()[1:], "--no-report", cwd=str(tmp_path))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    printed = proc.stdout.splitlines()
    missing = [s for s in sample if not _matches(s, printed)]
    assert not missing, "README lines diffkit no longer prints for the two files:\n" + "\n".join(missing)
    # the exit codes it lists are diffkit's
    from diffkit.errors import EXIT, INTERNAL
    table = dict(re.findall(r"^\| (\d) \| (\w+)", text, flags=re.M))
    assert table == {str(EXIT["match"]): "match", str(EXIT["diverged"]): "diverged", str(EXIT["error"]): "an",
                     str(INTERNAL): "an"}, table
