"""diffkit.compare's arguments (issue 45): options it was given are honoured (`sync_weights` copies the reference's
weights into the candidate, as diff_files and the CLI's --sync-weights do), and arguments it cannot take get a
sentence that says what to call instead, not an AttributeError from deep inside."""
import os

import pytest
import torch
import torch.nn as nn

import diffkit


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _pair():
    torch.manual_seed(1)
    ref = _Two()
    torch.manual_seed(2)  # the same architecture, other weights
    return ref, _Two()


def test_sync_weights_is_honoured_by_compare():
    x = torch.randn(4, 6)
    ref, cand = _pair()
    plain = diffkit.compare(ref, cand, [x])
    assert plain.verdict == "diverged"
    synced = diffkit.compare(ref, cand, [x], sync_weights=True)
    assert synced.verdict == "match", synced.summary_line()
    assert synced.weights is not None and synced.weights.synced
    assert sorted(synced.weights.copied) == ["a.bias", "a.weight", "b.bias", "b.weight"]
    assert synced.meta["protocol"]["sync_weights"] is True
    assert torch.equal(cand.a.weight, ref.a.weight)


def test_sync_weights_is_honoured_by_diff_files_and_the_cli(tmp_path):
    from conftest import run_cli

    src = ("import torch, torch.nn as nn\n"
           "class {cls}(nn.Module):\n"
           "    def __init__(self):\n        super().__init__()\n{draw}"
           "        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 3)\n"
           "    def forward(self, x):\n        return self.b(torch.relu(self.a(x)))\n"
           "def get_inputs():\n    return [torch.randn(4, 6)]\ndef get_init_inputs():\n    return []\n")
    ref, cand = tmp_path / "ref.py", tmp_path / "cand.py"
    ref.write_text(src.format(cls="Model", draw=""))
    # the candidate draws something first: its layers get other weights than KernelBench's seeded construction gives
    cand.write_text(src.format(cls="ModelNew", draw="        torch.randn(7)\n"))
    assert diffkit.diff_files(str(ref), str(cand), trials=1).verdict == "diverged"
    synced = diffkit.diff_files(str(ref), str(cand), trials=1, sync_weights=True)
    assert synced.verdict == "match" and synced.weights.synced, synced.summary_line()
    proc = run_cli("diff", ref, cand, "--sync-weights", "--trials", "1", "--no-report")
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]


@pytest.mark.parametrize("args,words", [
    (("ref.py", "cand.py"), "diffkit.diff_files"),
    ((os.path.join("a", "ref.py"), _Two(), [torch.randn(2, 6)]), "diffkit.diff_files"),
    ((_Two(), 3, [torch.randn(2, 6)]), "the candidate model must be a torch.nn.Module, not int"),
    ((_Two(), _Two(), torch.randn(2, 6)), "`inputs` must be a list or tuple"),
    ((_Two(), _Two()), "`inputs` must be a list or tuple"),
])
def test_arguments_compare_cannot_take_get_a_sentence(args, words):
    with pytest.raises(TypeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        diffkit.compare(*args)


def test_a_generator_of_inputs_is_read_once():
    ref, cand = _pair()
    cand.load_state_dict(ref.state_dict())
    x = torch.randn(4, 6)
    assert diffkit.compare(ref, cand, (t for t in [x])).verdict == "match"
