"""GPU: every CUDA candidate through `diffkit diff --device cuda` (skipped without a GPU)."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, candidates

CASES = candidates("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("name,ref,cand,exp", CASES, ids=[c[0] for c in CASES])
def test_cuda_candidate(name, ref, cand, exp, tmp_path):
    extra = ["--sanitize", exp["sanitize"]] if exp and exp.get("sanitize") else []  # bugs only a sanitizer shows
    out = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", ref, cand, "--device", "cuda",
                          "--json", str(tmp_path / "r.json"), "--no-report", "--timeout", "300", *extra],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    print(out.stdout[-3000:])
    data = json.loads((tmp_path / "r.json").read_text())
    if exp is None:
        assert out.returncode == 0 and data["verdict"] == "match", out.stdout[-2000:]
        return
    if data["verdict"] == "error":
        if exp.get("sanitize") and "failed on its own" in data["error"]["message"]:
            # compute-sanitizer broke inside the candidate's process (seen with racecheck on Hopper: "failed to
            # handle a hardware exception"): the error says so, and what it reported before still names the race
            fd = data["first_divergence"]
            assert fd is not None and exp["stage"] in (fd["ref_name"], fd["cand_name"]), fd
            assert exp["kind"] in [f["kind"] for f in (data["root_cause"] or fd)["diagnosis"]]
            return
        assert exp.get("kind") is None, data["error"]  # only the overflow may crash the kernel
        return
    fd = data["first_divergence"]
    assert fd is not None and exp["stage"] in (fd["ref_name"], fd["cand_name"]), fd
    if exp.get("kind"):
        kinds = [f["kind"] for f in (data["root_cause"] or fd)["diagnosis"]]
        assert exp["kind"] in kinds, kinds


def _diff(ref, cand, tmp_path, *extra, env=None):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", os.path.join(ROOT, ref),
                          os.path.join(ROOT, cand), "--device", "cuda", "--json", str(tmp_path / "r.json"), "--no-report",
                          "--timeout", "500", *extra], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env=env)
    print(out.stdout[-4000:], out.stderr[-2000:])
    return out, json.loads((tmp_path / "r.json").read_text())


@pytest.mark.cuda
@pytest.mark.parametrize("cand", ["kernels/axial_attention_cuda_tail.py", "kernels/axial_attention_cuda.py"])
def test_the_default_gpu_diff_streams_in_one_child_and_answers_as_a_child_per_side_does(tmp_path, cand):
    """Issue 46: on a GPU the default diff runs both sides in one child, streaming with the captured values on the
    device held to the models' own size; its answer is the one a child per side with every value on the device
    (DIFFKIT_GPU_PER_SIDE=1, the default before) gives."""
    got = []
    for per_side in ("0", "1"):
        out, d = _diff("references/axial_attention.py", cand, tmp_path,
                       env={**os.environ, "DIFFKIT_GPU_PER_SIDE": per_side})
        fd = d["first_divergence"] or {}
        got.append((out.returncode, d["verdict"], fd.get("ref_name"), fd.get("max_abs"),
                    [f["kind"] for f in fd.get("diagnosis", [])], [t.get("allclose") for t in d["trials"]]))
        if per_side == "0":
            assert d["meta"]["processes"] == "one child process, both sides"
            assert d["meta"]["mode"] == "streaming" and d["meta"]["max_memory"] >= 1 << 30, d["meta"]
        else:
            assert d["meta"]["processes"] == "a child process per side"
    assert got[0] == got[1]


@pytest.mark.cuda
def test_children_forked_on_a_gpu_give_the_answer_of_fresh_ones(tmp_path):
    """An isolated diff's children forked from a parent that never started CUDA (the default), each starting
    its own: the same verdict, first divergence, diagnosis and numbers as children in fresh interpreters."""
    keys = []
    for fork in ("0", "1"):
        out, d = _diff("references/axial_attention.py", "kernels/axial_attention_cuda_tail.py", tmp_path,
                       env={**os.environ, "DIFFKIT_FORK_GPU": fork})
        fd = d["first_divergence"]
        keys.append((out.returncode, d["verdict"], fd["ref_name"], fd["max_abs"],
                     [f["kind"] for f in fd["diagnosis"]], d["meta"]["processes"]))
    assert keys[0] == keys[1]
    assert keys[0][1] == "diverged"


@pytest.mark.cuda
def test_sanitize_memcheck_names_the_overflowing_kernel(tmp_path):
    out, data = _diff("references/axial_attention_large.py", "kernels/axial_attention_cuda_smem.py", tmp_path,
                      "--sanitize", "memcheck")
    reports = data["meta"].get("sanitizer") or []
    assert reports and any(r["kernel"] == "ln_linear_kernel" for r in reports), reports
    found = [f for s in data["stages"] for f in s.get("diagnosis", []) if f["kind"] == "memory_error"]
    # the overflowing call raised, so it has no stage: the report joins the error, which names that call
    assert found or "ln_linear_kernel" in data["error"]["message"] + " ".join(data["warnings"])


@pytest.mark.cuda
def test_sanitize_racecheck_attaches_race_to_the_triangle_stage(tmp_path):
    out, data = _diff("references/triangle_multiplicative_update.py",
                      "kernels/triangle_multiplicative_update_cuda_race.py", tmp_path, "--sanitize", "racecheck")
    reports = data["meta"].get("sanitizer") or []
    assert any(r["kernel"] == "triangle_kernel" for r in reports), reports
    stage = next(s for s in data["stages"] if any(f["kind"] == "race" for f in s.get("diagnosis", [])))
    assert stage["cand_op"].endswith("triangle_outgoing"), stage


@pytest.mark.cuda
def test_streaming_diff_on_gpu_same_answer(tmp_path):
    a, da = _diff("references/axial_attention.py", "kernels/axial_attention_cuda_tail.py", tmp_path)
    b, db = _diff("references/axial_attention.py", "kernels/axial_attention_cuda_tail.py", tmp_path,
                  "--max-memory", "64K")
    key = lambda d: (d["verdict"], (d["first_divergence"] or {}).get("ref_name"))
    assert key(da) == key(db) and db["meta"]["mode"] == "streaming"
    assert db["meta"]["peak_device_bytes"] <= 64 << 10 and da["verdict"] == "diverged"


@pytest.mark.cuda
def test_a_streaming_match_keeps_its_outputs_on_the_host_and_a_divergence_brings_them_to_the_device():
    """A streaming diff's last step fetches the values the report and the checks read: on a match they stay on
    the host (nothing is replayed; a large model's outputs are not held on the card twice over), on a
    divergence they come to the device, where the diagnosis replays calls."""
    import torch

    import diffkit

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda()
    same = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda()
    same.load_state_dict(ref.state_dict())
    off = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda()
    off.load_state_dict(ref.state_dict())
    with torch.no_grad():
        off[0].bias += 1.0
    x = [torch.randn(8, 64, device="cuda")]
    for cand, verdict, where in ((same, "match", "cpu"), (off, "diverged", "cuda")):
        res = diffkit.compare(ref, cand, x, max_memory=1 << 20)
        assert res.verdict == verdict and res.meta.get("mode") == "streaming", (res.verdict, res.meta.get("mode"))
        out = next(s for s in res.stages if s.cand is not None and s.cand.is_output and s.ref is not None)
        rv, cv = out.values.ref(out.ref.index), out.values.cand(out.cand.index)
        assert rv is not None and cv is not None
        assert rv.device.type == where and cv.device.type == where, (verdict, rv.device, cv.device)


# ------------------------------------------------------------------ KernelBench's protocol on the GPU (issue 13)
RACE = ("references/row_softmax_large.py", "kernels/row_softmax_cuda_race.py")


@pytest.mark.cuda
def test_block_reduction_race_is_found_by_the_trials(tmp_path):
    """The read-then-overwrite race (thread 0 overwrites red[0] while other warps still read the maximum
    from it): five trials, each running the candidate twice, find it without a sanitizer."""
    out, data = _diff(*RACE, tmp_path)
    assert out.returncode == 1 and data["verdict"] == "diverged", data["summary"]
    assert len(data["trials"]) == 5 and [t["seed"] for t in data["trials"]][:2] == [734796314, 576165995]
    failed = [t for t in data["trials"] if not t["allclose"]]
    assert failed, data["trials"]
    racy = [t for t in data["trials"] if t["nondeterministic"]]
    assert racy, "the two runs of some trial differ bitwise"
    kinds = {f["kind"] for f in data["findings"]} | {f["kind"] for s in data["stages"] for f in s["diagnosis"]}
    assert "nondeterministic" in kinds, kinds


@pytest.mark.cuda
def test_sanitize_racecheck_names_kernel_shared_array_and_stage_in_minutes(tmp_path):
    import time

    t0 = time.monotonic()
    out, data = _diff(*RACE, tmp_path, "--sanitize", "racecheck")
    elapsed = time.monotonic() - t0
    reports = data["meta"].get("sanitizer") or []
    assert reports and all(r["kernel"] == "softmax_rows_kernel" for r in reports), reports  # only its own kernels
    stage, finding = next((s, f) for s in data["stages"] for f in s["diagnosis"] if f["kind"] == "race")
    assert stage["cand_op"].endswith("softmax_rows"), stage["cand_op"]
    assert "softmax_rows_kernel" in finding["detail"] and "shared array red" in finding["detail"], finding
    assert data["verdict"] == "diverged"
    assert elapsed < 180, f"racecheck took {elapsed:.0f} s"


# ------------------------------------------------------------------ a launch per step writing into the output
@pytest.mark.cuda
def test_triton_launch_per_step_into_the_output_folds(tmp_path, monkeypatch):
    """A bidirectional GRU whose Triton launch per step and direction writes its state straight into the
    layer's output: the launches past FOLD_AFTER fold (the output-sized argument is judged against the
    reference's writes, of which it has none), the filled output is recorded when read, the verdict stands."""
    monkeypatch.setenv("DIFFKIT_GRU_LAYERS", "2")
    monkeypatch.setenv("DIFFKIT_GRU_SEQ", "48")
    # (the reference, cuDNN's GRU, runs its matmuls in TF32 on this GPU: 3e-4 from a float32 loop)
    out, data = _diff("references/gru_bidirectional.py", "kernels/bench/gru_bidirectional_triton_steps.py", tmp_path,
                      "--atol", "1e-3", "--rtol", "1e-3")
    assert out.returncode == 0 and data["verdict"] == "match", data["summary"]
    assert data["meta"]["cand_folded"]["results"] > 0
    writes = [s for s in data["stages"] if s["cand"] and s["cand"]["kind"] == "write"]
    # per layer: the first launches' writes, then the filled output once (the second layer's is the model's output)
    assert 0 < len(writes) <= 2 * 8 + 2, [s["cand_name"] for s in writes]
    assert data["meta"]["cand_records"] < 2 * 2 * 48


# ------------------------------------------------------------------ the reference's values handed over on the GPU
def _diff_env(ref, cand, out_json, env_extra=None, *extra):
    env = dict(os.environ, **(env_extra or {}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "cli.py"), "diff", os.path.join(ROOT, ref),
                          os.path.join(ROOT, cand), "--device", "cuda", "--json", str(out_json), "--no-report",
                          "--timeout", "300", *extra], capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    print(out.stdout[-3000:], out.stderr[-2000:])
    return out, json.loads(out_json.read_text())


@pytest.mark.cuda
def test_values_handed_over_on_the_gpu_give_the_answer_of_one_process(tmp_path):
    """The isolated diff's reference process hands its device values over as CUDA IPC handles: the same stages
    and numbers as one process, and as the hand-over through files.  (A child per side, as a diff runs when its
    one child for both sides did not run clean: DIFFKIT_TWO_PROCESSES=1 goes there at once.)"""
    pair = ("references/axial_attention.py", "kernels/axial_attention_cuda_tail.py")
    per_side = {"DIFFKIT_TWO_PROCESSES": "1"}
    _, ipc = _diff_env(*pair, tmp_path / "ipc.json", per_side)
    _, one = _diff_env(*pair, tmp_path / "one.json", None, "--no-isolate")
    _, files = _diff_env(*pair, tmp_path / "files.json", {**per_side, "DIFFKIT_NO_HANDOVER": "1"})
    assert ipc["meta"].get("reference_values") == "handed over on the device"
    assert "reference_values" not in files["meta"] and "reference_values" not in one["meta"]
    key = lambda d: [(s["ref_name"], s["cand_name"], s["status"], s["max_abs"]) for s in d["stages"]]
    assert ipc["verdict"] == "diverged" and key(ipc) == key(one) == key(files)


GPU_CRASH = """
import ctypes, runpy
_ref = runpy.run_path({ref!r})
get_inputs, get_init_inputs = _ref["get_inputs"], _ref["get_init_inputs"]


class ModelNew(_ref["Model"]):
    def forward(self, x):
        normed = self.ln1(x)
        mixed = self.qkv(normed)
        ctypes.string_at(0)
"""


@pytest.mark.cuda
def test_a_crash_after_the_hand_over_compares_what_was_captured(tmp_path):
    """The candidate's process dies holding handles to the reference's device values: the reference's process
    writes them into its capture, and the crash report compares the stages before the crash against them."""
    cand = tmp_path / "cand.py"
    cand.write_text(GPU_CRASH.format(ref=os.path.join(ROOT, "references", "transformer_block.py")))
    out, data = _diff_env("references/transformer_block.py", str(cand), tmp_path / "r.json")
    assert out.returncode == 2 and data["verdict"] == "error" and "SIGSEGV" in data["error"]["message"]
    ok = {s["ref_name"]: s for s in data["stages"] if s["status"] == "ok" and s["max_abs"] is not None}
    assert "ln1" in ok and "qkv" in ok, [(s["ref_name"], s["status"]) for s in data["stages"]][:6]


@pytest.mark.cuda
def test_values_are_not_held_where_the_candidate_would_have_no_room(tmp_path, monkeypatch):
    """With too little device memory left beside what the reference holds, its values go into its capture
    at once (as without a hand-over), and nothing is held."""
    import diffkit
    from diffkit import handoff
    from diffkit.compare import capture_reference
    from diffkit.store import CaptureFile

    monkeypatch.setattr(handoff, "ROOM_FACTOR", 1e9)
    holder = handoff.Holder(str(tmp_path / "ref.dkt"))
    capture_reference(os.path.join(ROOT, "references", "transformer_block.py"), str(tmp_path / "ref.dkt"),
                      diffkit.Options(trials=1, device="cuda"), hand_over=holder.hand_over)
    assert not holder.holding and not (tmp_path / "ref.dkt" / handoff.HANDOFF_FILE).exists()
    back = CaptureFile.open(str(tmp_path / "ref.dkt")).load()
    assert back.output.value is not None and len(CaptureFile.open(str(tmp_path / "ref.dkt")).parameters()) > 0


@pytest.mark.cuda
def test_device_values_spilled_to_disk_are_kept_as_they_were_put(tmp_path, monkeypatch):
    # a device value's copy off the device is behind a CUDA event and its write on the spiller's thread:
    # a kernel that writes into the tensor right after it was put must not change what comes back
    import torch

    from diffkit import tiers
    from diffkit.stream import Budget, TieredStore

    monkeypatch.setattr(tiers._Spiller, "PIECE", 1 << 16)
    store = TieredStore(Budget(0), Budget(0), spill_dir=str(tmp_path))
    big = torch.randn(1 << 20, device="cuda")
    wide = torch.randn(300, 200, device="cuda").t()
    want = (big.cpu(), wide.cpu())
    store.put(0, big)
    store.put(1, wide)
    big.mul_(-1)
    wide.add_(7)
    assert store.slots[0].tier == "disk" and store.slots[1].tier == "disk"
    assert torch.equal(store.get(0), want[0]) and torch.equal(store.get(1), want[1])
    assert store.get(1).stride() == wide.stride()
    assert store.get(0, device="cuda").is_cuda
    store.clear()
    assert not os.listdir(tmp_path)
