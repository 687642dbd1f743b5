"""Capture files are data (issue 45): nothing in one is imported or executed, and every field of its index and
``info`` is checked once, where it is read, with a sentence naming the file and the field (exit 2, no traceback).

A real capture of references/gelu.py is made once; each case corrupts one field (or file) of a copy of it and runs
`diffkit diff COPY CANDIDATE.py` and `diffkit diff CLEAN COPY` (two captures)."""
import json
import os
import shutil

import pytest
import torch

from conftest import KERNELS, REFS, ROOT, run_cli

REF = os.path.join(REFS, "gelu.py")
CAND = os.path.join(KERNELS, "gelu_tail_fast_path.py")
LEAF = {"type": None, "context": None, "children_spec": []}


def _spec(children, typ="builtins.list", context="null"):
    return json.dumps([1, {"type": typ, "context": context, "children_spec": children}])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A capture of the gelu reference (5 trials), made once."""
    from diffkit.compare import capture_reference, diff_files

    d = tmp_path_factory.mktemp("clean") / "ref.dkt"
    capture_reference(REF, str(d))
    return str(d)


@pytest.fixture
def copy(clean, tmp_path):
    d = tmp_path / "bad.dkt"
    shutil.copytree(clean, d, symlinks=True)
    return str(d)


def _edit(path, fn, name="index.json"):
    p = os.path.join(path, name)
    with open(p, encoding="utf-8") as fh:
        d = json.load(fh)
    fn(d)
    with open(p, "w", encoding="utf-8") as fh:
        json.dump(d, fh)


def _info(fn):
    return lambda path: _edit(path, lambda d: fn(d["info"]))


def _rec(i, fn):
    return lambda path: _edit(path, lambda d: fn(d["records"][i]))


def _set(where, key, value):
    def fn(d):
        where(d)[key] = value
    return fn


def _outside(path, name):
    """Replace member `name` by a symbolic link to a copy of it outside the capture."""
    src = os.path.join(path, name)
    dst = os.path.join(os.path.dirname(path), "outside-" + name)
    (shutil.copytree if os.path.isdir(src) else shutil.copy)(src, dst)
    (shutil.rmtree if os.path.isdir(src) else os.remove)(src)
    os.symlink(dst, src)


def _raw(fn):
    def edit(path):
        p = os.path.join(path, "index.json")
        with open(p, "rb") as fh:
            data = fh.read()
        with open(p, "wb") as fh:
            fh.write(fn(data))
    return edit


def _del(key):
    return lambda d: d.pop(key)


BOTH, FILE = ("file", "captures"), ("file",)

# (id, corruption of the copy, words the error must hold, the diffs it is checked in)
CASES = [
    # the index itself
    ("index truncated", _raw(lambda b: b[: len(b) // 2]), "index.json is not valid JSON", BOTH),
    ("index not utf-8", _raw(lambda b: b"\xff\xfe" + b), "index.json is not valid UTF-8", BOTH),
    ("index a symlink", lambda p: _outside(p, "index.json"), "symbolic link", BOTH),
    ("format", lambda p: _edit(p, _set(lambda d: d, "format", 7)), "format field is 7", BOTH),
    ("version string", lambda p: _edit(p, _set(lambda d: d, "version", "2")), "format version '2'", BOTH),
    ("version huge", lambda p: _edit(p, _set(lambda d: d, "version", 10 ** 30)), "format version", BOTH),
    ("records not a list", lambda p: _edit(p, _set(lambda d: d, "records", {})), "field 'records'", BOTH),
    ("complete not bool", lambda p: _edit(p, _set(lambda d: d, "complete", "yes")), "field 'complete'", BOTH),
    ("error wrong type", lambda p: _edit(p, _set(lambda d: d, "error", 5)), "field 'error'", BOTH),
    ("info a list", lambda p: _edit(p, _set(lambda d: d, "info", [])), "field 'info' must be an object", BOTH),
    ("parameters escapes", lambda p: _edit(p, _set(lambda d: d, "parameters", "../params.safetensors")),
     "field 'parameters'", BOTH),
    ("inputs_left absolute", lambda p: _edit(p, _set(lambda d: d, "inputs_left", "/etc/passwd")),
     "field 'inputs_left'", BOTH),
    ("rng_after not a name", lambda p: _edit(p, _set(lambda d: d, "rng_after", 3)), "field 'rng_after'", BOTH),
    # records
    ("record dtype", _rec(0, _set(lambda m: m, "dtype", "float99")), "field 'dtype'", BOTH),
    ("record negative size", _rec(1, _set(lambda m: m, "shape", [-4, 256])), "field 'shape'", BOTH),
    ("record huge size", _rec(1, _set(lambda m: m, "shape", [2 ** 70])), "field 'shape'", BOTH),
    ("record name missing", _rec(0, _del("name")), "field 'name' is missing", BOTH),
    ("record inputs out of range", _rec(1, _set(lambda m: m, "inputs", [7])), "field 'inputs'", BOTH),
    ("record index a string", _rec(0, _set(lambda m: m, "index", "0")), "field 'index'", BOTH),
    ("record line negative", _rec(1, _set(lambda m: m, "line", -1)), "field 'line'", BOTH),
    ("shard escapes", _rec(0, _set(lambda m: m, "shard", "../shard-00000.safetensors")), "field 'shard'", BOTH),
    ("shard absolute", _rec(1, _set(lambda m: m, "shard", "/etc/passwd")), "field 'shard'", BOTH),
    # files on disk
    ("shard missing", lambda p: os.remove(os.path.join(p, "shard-00001.safetensors")), "field 'shard'", BOTH),
    ("shard renamed", lambda p: os.rename(os.path.join(p, "shard-00001.safetensors"),
                                          os.path.join(p, "shard-00009.safetensors")), "field 'shard'", BOTH),
    ("shard symlinked outside", lambda p: _outside(p, "shard-00001.safetensors"), "field 'shard'", BOTH),
    ("shard truncated", lambda p: open(os.path.join(p, "shard-00001.safetensors"), "r+b").truncate(100),
     "truncated or corrupt", BOTH),
    ("parameters symlinked outside", lambda p: _outside(p, "params.safetensors"), "field 'parameters'", FILE),
    ("parameters missing", lambda p: os.remove(os.path.join(p, "params.safetensors")), "field 'parameters'", FILE),
    ("trial dir symlinked outside", lambda p: _outside(p, "trial-2.dkt"), "info.trials[1].capture", BOTH),
    ("trial dir missing", lambda p: shutil.rmtree(os.path.join(p, "trial-2.dkt")), "info.trials[1].capture", BOTH),
    ("trial index seed", lambda p: _edit(p, lambda d: d["info"].update(seed="x"), "trial-2.dkt/index.json"),
     "field 'info.seed'", BOTH),
    # info
    ("init_inputs missing", _info(_del("init_inputs")), "info.init_inputs", FILE),
    ("init_inputs a string", _info(_set(lambda i: i, "init_inputs", "x")), "field 'info.init_inputs'", BOTH),
    ("init_inputs spec garbage", _info(lambda i: i["init_inputs"].update(spec="garbage")),
     "field 'info.init_inputs.spec'", BOTH),
    ("init_inputs spec missing", _info(lambda i: i["init_inputs"].pop("spec")), "info.init_inputs.spec", BOTH),
    ("init_inputs namedtuple", _info(lambda i: i["init_inputs"].update(spec=_spec([], "collections.namedtuple"))),
     "info.init_inputs.spec", BOTH),
    ("init_inputs leaf count", _info(lambda i: i["init_inputs"].update(leaves=[{"value": 1}])),
     "info.init_inputs.leaves", BOTH),
    ("init_inputs huge int", _info(lambda i: i.update(init_inputs={"spec": _spec([LEAF]),
                                                                   "leaves": [{"value": 2 ** 70}]})),
     "info.init_inputs.leaves[0]", BOTH),
    ("init_inputs nan", _info(lambda i: i.update(init_inputs={"spec": _spec([LEAF]),
                                                              "leaves": [{"value": float("nan")}]})),
     "info.init_inputs.leaves[0]", BOTH),
    ("init_inputs tensor leaf", _info(lambda i: i.update(init_inputs={"spec": _spec([LEAF]),
                                                                      "leaves": [{"tensor": "input[0]"}]})),
     "info.init_inputs.leaves[0]", BOTH),
    ("inputs leaf names no record", _info(lambda i: i["inputs"]["leaves"][0].update(tensor="input[5]")),
     "info.inputs.leaves[0]", BOTH),
    ("inputs leaf not a name", _info(lambda i: i["inputs"]["leaves"].__setitem__(0, {"tensor": 3})),
     "info.inputs.leaves[0]", BOTH),
    ("inputs a list", _info(_set(lambda i: i, "inputs", [1])), "field 'info.inputs'", BOTH),
    ("seed a string", _info(_set(lambda i: i, "seed", "abc")), "field 'info.seed'", BOTH),
    ("input_seed a float", _info(_set(lambda i: i, "input_seed", 1.5)), "field 'info.input_seed'", BOTH),
    ("seed huge", _info(_set(lambda i: i, "seed", 10 ** 30)), "field 'info.seed'", BOTH),
    ("trial seed a string", _info(lambda i: i["trials"][1].update(seed="x")), "info.trials[1].seed", BOTH),
    ("trial seed missing", _info(lambda i: i["trials"][2].pop("seed")), "info.trials[2].seed", BOTH),
    ("trial escapes", _info(lambda i: i["trials"][1].update(capture="../trial-2.dkt")),
     "info.trials[1].capture", BOTH),
    ("trial absolute", _info(lambda i: i["trials"][1].update(capture="/tmp")), "info.trials[1].capture", BOTH),
    ("trial dir of another trial", _info(lambda i: i["trials"][1].update(capture="trial-3.dkt")),
     "info.trials[1].capture", BOTH),
    ("trials not a list", _info(_set(lambda i: i, "trials", "all")), "field 'info.trials'", BOTH),
    ("trial number missing", _info(lambda i: i["trials"][1].pop("trial")), "info.trials[1].trial", BOTH),
    ("trial entry a number", _info(lambda i: i["trials"].__setitem__(3, 4)), "info.trials[3]", BOTH),
    ("device unknown", _info(_set(lambda i: i, "device", "tpu:0")), "field 'info.device'", BOTH),
    ("training a string", _info(_set(lambda i: i, "training", "yes")), "field 'info.training'", BOTH),
    ("eval a number", _info(_set(lambda i: i, "eval", 1)), "field 'info.eval'", BOTH),
    ("inputs_layout wrong length", _info(_set(lambda i: i, "inputs_layout", [])), "field 'info.inputs_layout'", BOTH),
    ("inputs_layout negative offset", _info(_set(lambda i: i, "inputs_layout", [[[256, 1], -1, 0, 0]])),
     "info.inputs_layout[0]", BOTH),
    ("inputs_layout later input", _info(_set(lambda i: i, "inputs_layout", [[[256, 1], 0, 3, 0]])),
     "info.inputs_layout[0]", BOTH),
    ("reinit_zero a string", _info(_set(lambda i: i, "reinit_zero", "w")), "field 'info.reinit_zero'", BOTH),
    ("health numbers", _info(_set(lambda i: i, "health", [1])), "field 'info.health'", BOTH),
    ("class not a name", _info(_set(lambda i: i, "class", "os.system('x')")), "field 'info.class'", BOTH),
    ("source a number", _info(_set(lambda i: i, "source", 12)), "field 'info.source'", BOTH),
    ("rerun_differs bad count", _info(_set(lambda i: i, "rerun_differs", {"output": {"elements": "x"}})),
     "info.rerun_differs", BOTH),
]
RUNS = [(c[0], mode) for c in CASES for mode in c[3]]


def test_cases_are_many_and_distinct():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case,mode", RUNS, ids=[f"{c}-{m}" for c, m in RUNS])
def test_a_corrupt_field_is_a_sentence_naming_it(clean, copy, case, mode):
    _, corrupt, words, _ = next(c for c in CASES if c[0] == case)
    corrupt(copy)
    args = [copy, CAND] if mode == "file" else [clean, copy]
    proc = run_cli("diff", *args, "--no-report", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert words in out, out[-3000:]
    assert "Traceback" not in out and "INTERNAL ERROR" not in out, out[-3000:]
    assert "diffkit: ERROR:" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_capture_made_on_a_gpu_diffed_on_a_cpu_machine_names_the_device(copy):
    _info(_set(lambda i: i, "device", "cuda"))(copy)
    proc = run_cli("diff", copy, CAND, "--no-report", timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "field 'info.device' is 'cuda'" in out and "--device cpu" in out, out[-3000:]
    assert "Traceback" not in out
    # on the CPU, as the sentence says: the answer of the clean capture
    proc = run_cli("diff", copy, CAND, "--no-report", "--device", "cpu", timeout=300)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]


# ----------------------------------------------------------------------------- nothing in a capture is run

EVIL = """import os
open(os.path.join({where!r}, "MARKER-" + os.path.basename(__file__)), "w").write("ran")
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x
def get_inputs():
    return [torch.randn(4, 256)]
def get_init_inputs():
    return []
"""


def _answer(proc):
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("diffkit: ")]
    return proc.returncode, lines[-1] if lines else proc.stdout[-2000:]


@pytest.fixture
def evil(tmp_path):
    """Files a capture may name that write a marker when run or imported (here and in the working directory)."""
    for name in ("evil_ref.py", "evil_mod.py"):
        (tmp_path / name).write_text(EVIL.format(where=str(tmp_path)))
    return tmp_path


def _no_marker(evil):
    assert not [n for n in os.listdir(evil) if n.startswith("MARKER")]
    assert not [n for n in os.listdir(ROOT) if n.startswith("MARKER")]


def test_code_bearing_fields_are_never_run_and_the_answer_stands(clean, copy, evil):
    expected = _answer(run_cli("diff", clean, CAND, "--no-report", timeout=300))
    assert expected[0] == 1
    path = str(evil / "evil_ref.py")

    def plant(i):
        i.update(source=path, inputs_source=path, inputs_layout=[[[256, 1], 0, 0, 0]])
        for t in i["trials"][1:]:
            t["outputs_only"] = True  # (an outputs-only trial is rebuilt from its source only in a diff's own capture)
    _info(plant)(copy)
    for k in range(2, 6):
        _edit(os.path.join(copy, f"trial-{k}.dkt"), lambda d: d["info"].update(source=path, inputs_source=path))
    proc = run_cli("diff", copy, CAND, "--no-report", cwd=str(evil), timeout=300)
    assert _answer(proc) == expected, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = run_cli("diff", clean, copy, "--no-report", cwd=str(evil), timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr  # (the same capture, twice)
    _no_marker(evil)


def test_a_capture_without_init_inputs_does_not_run_the_file_it_names(copy, evil):
    path = str(evil / "evil_ref.py")
    _info(lambda i: (i.pop("init_inputs"), i.update(source=path, inputs_source=path)))(copy)
    proc = run_cli("diff", copy, CAND, "--no-report", cwd=str(evil), timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "field 'info.init_inputs'" in out and "Traceback" not in out, out[-3000:]
    _no_marker(evil)


@pytest.mark.parametrize("spec", [
    # a dict key decoded by torch's enum hook imports the module it names
    _spec([LEAF], "builtins.dict", json.dumps([{"__enum__": True, "fqn": "evil_mod:X", "name": "A"}])),
    # a defaultdict's context names a module and a factory, which torch imports
    _spec([LEAF], "collections.defaultdict", json.dumps({"default_factory_module": "evil_mod",
                                                         "default_factory_name": "Model",
                                                         "dict_context": ["a"]})),
], ids=["enum-import", "defaultdict-import"])
@pytest.mark.parametrize("field", ["init_inputs", "inputs"])
def test_a_stored_structure_never_imports_a_module(clean, copy, evil, spec, field):
    leaf = {"value": 1} if field == "init_inputs" else {"tensor": "input[0]"}
    _info(lambda i: i.update({field: {"spec": spec, "leaves": [leaf]}}))(copy)
    for args in ([copy, CAND], [clean, copy]):
        proc = run_cli("diff", *args, "--no-report", cwd=str(evil), timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 2 and f"field 'info.{field}" in out and "Traceback" not in out, out[-3000:]
    _no_marker(evil)


def test_decode_values_reads_structures_as_data():
    from diffkit.load import decode_values, encode_values

    values = [1, (2.5, "a"), {"k": None, 3: True}, [], torch.Size([2, 3])]
    assert decode_values(encode_values(values)) == values
    with pytest.raises(ValueError):
        decode_values({"spec": _spec([LEAF], "collections.deque", "null"), "leaves": [{"value": 1}]})


# ----------------------------------------------------------------------------- a captured candidate, a file reference

def test_a_captured_candidate_against_a_reference_file(clean, tmp_path):
    from diffkit.compare import capture_reference, diff_files

    cand = str(tmp_path / "cand.dkt")
    capture_reference(CAND, cand, class_name="ModelNew", inputs_from=REF, side="candidate")
    both = _answer(run_cli("diff", clean, cand, "--no-report", timeout=300))
    proc = run_cli("diff", REF, cand, "--no-report", timeout=300)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out
    if proc.returncode == 2:  # refused: the sentence says what to do
        assert "needs a captured reference" in out and "diffkit capture" in out and " -o " in out, out[-2000:]
    else:  # supported: the answer of the two captures
        assert _answer(proc) == both, out[-3000:]
    # what supporting it takes (capture the reference file as `diffkit capture` does, diff the two captures) gives
    # that answer
    ref = str(tmp_path / "ref-again.dkt")
    capture_reference(REF, ref)
    again = diff_files(ref, cand)
    first = diff_files(clean, cand)
    assert again.verdict == first.verdict == "diverged"
    assert [t["allclose"] for t in again.trials] == [t["allclose"] for t in first.trials]
    assert again.first_divergence.stats.max_abs == first.first_divergence.stats.max_abs
