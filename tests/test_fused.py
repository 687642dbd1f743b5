"""The fused twins of issue 16 (kernels/fused/): every deterministic broken variant in kernels/ and
kernels/corpus/ written again as ONE extension call per forward, so diffkit sees only input -> output.

Each twin declares DIFFKIT_EXPECT: a broken one the stage "output" (nothing else is visible) and the
what-if mutation that should explain it; a correct one `"verdict": "match"`.  Here each is diffed through
the library as the other tests do (KernelBench's protocol, five trials): a broken twin must diverge with
its first divergence at the output, a correct one must match.  The what-if engine does not exist yet, so
nothing runs it; only the declarations are checked for form (catalogue kinds, real reference stages).
Twins whose name contains `_cuda` or that declare `"device": "cuda"` run with device="cuda" and are marked
`cuda` (skipped without a GPU).
"""
import ast
import os
import runpy

import pytest
import torch

import diffkit

from conftest import diff_once, same_pair

pytestmark = pytest.mark.slow  # builds the fused C++ extension (about a minute on two cores)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUSED = os.path.join(ROOT, "kernels", "fused")
REFERENCES = os.path.join(ROOT, "references")
ORIGINAL_DIRS = [os.path.join(ROOT, "kernels"), os.path.join(ROOT, "kernels", "corpus")]

CATALOGUE = {"drop_bias", "extra_bias", "running_stats", "batch_stats", "unbiased_variance", "biased_variance",
             "epsilon", "reduce_axis", "scale", "transposed_weight", "transposed_operand", "swapped_operands",
             "tanh_gelu", "erf_gelu", "low_precision", "unwritten_tail", "clamp", "sign_flip", "unstable_softmax"}

# broken originals with no fused twin (kernels/fused/README.md gives the same reasons)
EXCLUDED = {
    "invariant_point_attention_crash.py": "crashes (the inverse frame kernel rejects un-flattened points)",
    "transformer_block_racy_softmax.py": "nondeterministic by design (run-dependent noise)",
    "axial_attention_cuda_race.py": "a race (missing __syncthreads): shown by racecheck, by two runs on some cards",
    "row_softmax_cuda_race.py": "a race (shared accumulator read then overwritten): nondeterministic",
    "triangle_multiplicative_update_cuda_race.py": "a race, seen only under racecheck: nondeterministic",
    "axial_attention_cuda_smem.py": "GPU-only shared-memory overflow: undefined behaviour, no deterministic output",
    "conv_tanh_pool_params_out_of_order.py": "its kernels are right, its weights are not (parameters created in "
                                             "another order): no mistake in the reference's computation expresses it",
}


def _declared(path):
    """DIFFKIT_EXPECT of a candidate file, read from its source without running it."""
    for node in ast.parse(open(path, encoding="utf-8").read(), path).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "DIFFKIT_EXPECT" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _on_gpu(name, exp):
    return exp.get("device") == "cuda" or "_cuda" in name


def _twins():
    out = []
    for name in sorted(os.listdir(FUSED)):
        if name.endswith(".py") and not name.startswith("_"):
            exp = _declared(os.path.join(FUSED, name))
            assert exp is not None, f"kernels/fused/{name} declares no DIFFKIT_EXPECT"
            marks = [pytest.mark.cuda] if _on_gpu(name, exp) else [same_pair(os.path.join(FUSED, name))]
            out.append(pytest.param(name, exp, id=name[:-3], marks=marks))
    return out


CASES = _twins()
CPU_CASES = [p for p in CASES if not _on_gpu(*p.values)]


@pytest.mark.parametrize("name,exp", CASES)
def test_fused_candidate(name, exp):
    ref, cand = os.path.join(REFERENCES, exp["reference"]), os.path.join(FUSED, name)
    # on the CPU: the Result test_whatif reads too (the what-if search run once)
    result = diffkit.diff_files(ref, cand, device="cuda") if _on_gpu(name, exp) else diff_once(ref, cand)
    assert result.error is None, f"diffkit reported an error: {result.error}"
    compared = [s.ref_name for s in result.compared]
    assert len(compared) == 1 and result.compared[0].matches("output"), \
        f"a fused twin shows only its output, diffkit compared {compared}"
    if exp.get("verdict") == "match":
        assert result.verdict == "match", result.summary_line()
        assert result.first_divergence is None and result.output is not None and result.output.ok
        return
    assert exp["stage"] == "output"
    assert result.verdict == "diverged", result.summary_line()
    fd = result.first_divergence
    assert fd is not None and fd.matches("output"), result.summary_line()
    assert fd.stats.mismatches > 0


@pytest.mark.parametrize("name,exp", CPU_CASES)
def test_fused_forward_is_one_extension_call(name, exp):
    """Captured, the twin's forward is its inputs and one record: the output, made by the extension."""
    ref = runpy.run_path(os.path.join(REFERENCES, exp["reference"]))
    cand = runpy.run_path(os.path.join(FUSED, name))
    torch.manual_seed(42)
    model = cand["ModelNew"](*ref["get_init_inputs"]())
    torch.manual_seed(0)
    inputs = ref["get_inputs"]()
    with torch.no_grad(), diffkit.capture(model, inputs=inputs) as trace:
        model(*inputs)
    made = [r for r in trace if r.kind != "input"]
    assert [r.name for r in made] == ["output"], trace.format()
    assert made[0].op.startswith("ext:diffkit_fused_ops."), trace.format()


@pytest.mark.parametrize("name,exp", CPU_CASES)
def test_fused_weights_need_no_copy(name, exp):
    """KernelBench copies nothing: built with seed 42, the twin holds the reference's parameters and
    buffers, in the reference's order."""
    ref = runpy.run_path(os.path.join(REFERENCES, exp["reference"]))
    cand = runpy.run_path(os.path.join(FUSED, name))
    init = ref["get_init_inputs"]()
    torch.manual_seed(42)
    model = ref["Model"](*init)
    torch.manual_seed(42)
    new = cand["ModelNew"](*init)
    for what in ("parameters", "buffers"):
        r = [t.detach() for t in getattr(model, what)()]
        c = [t.detach() for t in getattr(new, what)()]
        assert [tuple(t.shape) for t in r] == [tuple(t.shape) for t in c], what
        for i, (a, b) in enumerate(zip(r, c)):
            assert torch.equal(a, b), f"{what} {i} differs from the reference's"


def _reference_stage_names(ref_file, _cache={}):
    if ref_file not in _cache:
        ns = runpy.run_path(os.path.join(REFERENCES, ref_file))
        torch.manual_seed(42)
        model = ns["Model"](*ns["get_init_inputs"]())
        torch.manual_seed(0)
        inputs = ns["get_inputs"]()
        with torch.no_grad(), diffkit.capture(model, inputs=inputs) as trace:
            model(*inputs)
        _cache[ref_file] = {n for r in trace for n in r.names()}
    return _cache[ref_file]


def test_fused_declarations():
    """Form only (the engine that would use what_if does not exist yet): every broken twin names a
    catalogue kind at a real reference stage, or null with a reason; every deterministic broken original
    has a twin or is excluded with a reason; every reference used has a correct twin."""
    twins = {p.values[0]: p.values[1] for p in CASES}
    for name, exp in twins.items():
        assert os.path.exists(os.path.join(REFERENCES, exp["reference"])), (name, exp["reference"])
        assert "what_if" in exp, f"{name}: no what_if"
        if exp.get("verdict") == "match":
            assert exp["what_if"] is None, name
            continue
        assert exp["stage"] == "output", name
        wi = exp["what_if"]
        if wi is None:
            assert exp.get("what_if_note"), f"{name}: what_if is null without a what_if_note"
            continue
        assert set(wi) == {"kind", "stage"}, (name, wi)
        assert wi["kind"] in CATALOGUE, f"{name}: {wi['kind']!r} is not a catalogue kind"
        names = _reference_stage_names(exp["reference"])
        assert wi["stage"] in names, f"{name}: {wi['stage']!r} is not a stage of {exp['reference']}"

    broken = {}
    for folder in ORIGINAL_DIRS:
        for f in sorted(os.listdir(folder)):
            if f.endswith(".py") and not f.startswith("_"):
                exp = _declared(os.path.join(folder, f))
                if exp and exp.get("verdict") != "match":
                    broken[f] = exp
    missing = sorted(set(broken) - set(twins) - set(EXCLUDED))
    assert not missing, f"broken originals with neither a fused twin nor a reason to have none: {missing}"
    assert not set(EXCLUDED) & set(twins), "an excluded original has a twin"
    for f in set(broken) & set(twins):
        assert twins[f]["reference"] == broken[f]["reference"], f
        assert twins[f]["kind"] == broken[f]["kind"], f"{f}: the twin's kind differs from the original's"
        assert _on_gpu(f, twins[f]) == _on_gpu(f, broken[f]), f
    for ref in {e["reference"] for e in twins.values()}:
        assert ref[:-3] + "_ok.py" in twins, f"no correct fused twin for {ref}"
