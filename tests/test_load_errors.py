"""Bad input gives a precise error: which side, which phase, where."""
import os

import pytest

import diffkit
from diffkit import DiffkitError

from conftest import REFS, run_cli

REF = os.path.join(REFS, "transformer_block.py")


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_missing_file(tmp_path):
    with pytest.raises(DiffkitError) as e:
        diffkit.load_pair(REF, str(tmp_path / "nope.py"))
    assert e.value.side == "candidate" and e.value.phase == "read" and "nope.py" in str(e.value)


def test_syntax_error_names_file_and_line(tmp_path):
    bad = _write(tmp_path, "bad.py", "import torch\n\nclass ModelNew(torch.nn.Module:\n    pass\n")
    with pytest.raises(DiffkitError) as e:
        diffkit.load_pair(REF, bad)
    assert e.value.side == "candidate" and e.value.phase == "parse" and e.value.where.startswith(f"{bad}:3")


def test_missing_class(tmp_path):
    empty = _write(tmp_path, "empty.py", "x = 1\n")
    with pytest.raises(DiffkitError) as e:
        diffkit.load_pair(empty, REF)
    assert e.value.side == "reference" and "`Model`" in e.value.message
    with pytest.raises(DiffkitError) as e:
        diffkit.load_pair(REF, empty)
    assert e.value.side == "candidate" and "`ModelNew`" in e.value.message


def test_exception_in_init(tmp_path):
    cand = _write(tmp_path, "c.py", "import torch\nclass ModelNew(torch.nn.Module):\n"
                  "    def __init__(self, *a):\n        super().__init__()\n        raise ValueError('bad dims')\n")
    with pytest.raises(DiffkitError) as e:
        diffkit.load_pair(REF, cand)
    assert e.value.side == "candidate" and e.value.phase == "init" and "bad dims" in e.value.message
    assert e.value.where == f"{cand}:5"


@pytest.mark.slow
def test_extension_that_does_not_compile(tmp_path):
    cand = _write(tmp_path, "c.py", "import torch\nfrom torch.utils.cpp_extension import load_inline\n"
                  "src = 'torch::Tensor f(torch::Tensor x) { return x + undefined_name; }'\n"
                  "ext = load_inline('diffkit_test_broken_ext', cpp_sources=[src], functions=['f'])\n"
                  "class ModelNew(torch.nn.Module):\n    def forward(self, x):\n        return ext.f(x)\n")
    with pytest.raises(DiffkitError) as e:
        diffkit.load_pair(REF, cand)
    err = e.value
    assert err.side == "candidate" and err.phase == "build"
    assert "undefined_name" in err.message and len(err.message.splitlines()) <= 10
    assert err.where == f"{cand}:4"
    # the CLI says the same and exits 2 (run in tmp_path: its default report folder is written there)
    proc = run_cli("diff", REF, cand, cwd=tmp_path)
    assert proc.returncode == 2 and "build failed" in proc.stdout and "undefined_name" in proc.stdout


def test_a_compiler_error_in_generated_source_is_traced_to_the_users_line(tmp_path):
    # load_inline writes the user's source string into main.cpp: the error's line is found in the .py file
    from diffkit.load import _first_compiler_errors

    user = tmp_path / "cand.py"
    user.write_text('SRC = r"""\n#include <torch/extension.h>\n'
                    'torch::Tensor twice(torch::Tensor x) { return x * 2 }\n"""\n')
    gen = tmp_path / "build" / "main.cpp"
    gen.parent.mkdir()
    gen.write_text("#include <torch/extension.h>\n\ntorch::Tensor twice(torch::Tensor x) { return x * 2 }\n")
    log = f"[1/2] c++ -c {gen} -o main.o\n{gen}:3:52: error: expected ';' before '}}' token\nninja: build stopped"
    text = _first_compiler_errors(log, source=str(user))
    assert text.endswith("(that is cand.py:3: torch::Tensor twice(torch::Tensor x) { return x * 2 })"), text
    assert _first_compiler_errors(log) == f"{gen}:3:52: error: expected ';' before '}}' token"


def test_a_constructor_called_with_other_arguments_points_at_its_definition(tmp_path):
    cand = _write(tmp_path, "cand.py", "import torch\n\n\nclass ModelNew(torch.nn.Module):\n"
                  "    def __init__(self, only_one):\n        super().__init__()\n")
    with pytest.raises(DiffkitError) as e:
        diffkit.load_pair(REF, cand)
    assert e.value.side == "candidate" and e.value.phase == "init", e.value
    assert e.value.where == f"{cand}:5", e.value.where


@pytest.mark.parametrize("text,words", [
    ("def get_inputs():\n    return [torch.randn(2, 3)]\ndef get_init_inputs():\n    return 3\n", "cannot unpack"),
    ("def get_inputs():\n    return 7\ndef get_init_inputs():\n    return []\n", "cannot unpack"),
])
def test_init_inputs_as_kernelbench_unpacks_them(tmp_path, text, words):
    ref = _write(tmp_path, "ref.py", "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n"
                 "        return x\n" + text)
    cand = _write(tmp_path, "cand.py", "import torch\nclass ModelNew(torch.nn.Module):\n    def forward(self, x):\n"
                  "        return x\n")
    with pytest.raises(DiffkitError, match=words) as e:
        diffkit.load_pair(ref, cand)
    assert e.value.side == "reference"


def test_a_candidate_without_modelnew_fails_as_kernelbench_fails_it(tmp_path):
    cand = _write(tmp_path, "cand.py", "import torch\nclass Model(torch.nn.Module):\n    def forward(self, x):\n"
                  "        return x\n")
    with pytest.raises(DiffkitError, match="defines no `ModelNew`.*defines `Model`") as e:
        diffkit.load_pair(REF, cand)
    assert e.value.side == "candidate"


def test_get_inputs_returning_a_tensor_is_unpacked_as_kernelbench_unpacks_it(tmp_path):
    # model(*tensor) passes its rows as arguments: a one-input forward given a [3, 4] tensor gets 3 arguments
    ref = _write(tmp_path, "ref.py", "import torch\nclass Model(torch.nn.Module):\n    def forward(self, a, b, c):\n"
                 "        return a + b * c\ndef get_inputs():\n    return torch.randn(3, 4)\n"
                 "def get_init_inputs():\n    return []\n")
    cand = _write(tmp_path, "cand.py", "import torch\nclass ModelNew(torch.nn.Module):\n"
                  "    def forward(self, a, b, c):\n        return torch.addcmul(a, b, c)\n")
    pair = diffkit.load_pair(ref, cand)
    assert len(pair.ref_inputs) == 3 and tuple(pair.ref_inputs[0].shape) == (4,)
    assert diffkit.diff_files(ref, cand).verdict == "match"
