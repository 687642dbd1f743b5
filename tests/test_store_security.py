"""Capture files from strangers (issue 14): links, hostile JSON, wrong-typed fields; and the
version-2 format (issue 11): info, parameters, per-record params, version-1 files still load."""
import json
import os

import pytest
import torch

from diffkit import DiffkitError, store
from diffkit.capture import capture
from diffkit.store import CaptureFile, CaptureWriter, load_trace, save_trace


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())


def _trace(model=None):
    model = model or _model()
    x = torch.randn(2, 4)
    with capture(model, inputs=(x,)) as trace:
        model(x)
    return trace


@pytest.fixture
def dkt(tmp_path):
    path = tmp_path / "run.dkt"
    save_trace(_trace(), str(path))
    return path


def _edit_index(path, edit):
    idx = json.loads((path / "index.json").read_text())
    edit(idx)
    (path / "index.json").write_text(json.dumps(idx))


def _fails(path, *words):
    with pytest.raises(DiffkitError) as e:
        load_trace(str(path))
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    return msg


def test_round_trip_small_model_and_safetensors_compatible(dkt):
    trace = _trace()
    back = load_trace(str(dkt))
    assert [r.name for r in back] == [r.name for r in trace]
    for a, b in zip(trace, back):
        assert (a.shape, a.dtype, a.inputs, a.line) == (b.shape, b.dtype, b.inputs, b.line)
        assert torch.equal(a.value, b.value)
    from safetensors.torch import load_file  # the shards stay plain safetensors

    shard = load_file(str(dkt / "shard-00000.safetensors"))
    assert torch.equal(shard["r000001"], trace[1].value)


def test_round_trip_dtypes(tmp_path):
    path = tmp_path / "d.dkt"
    w = CaptureWriter(str(path))
    vals = [torch.tensor([True, False, True]), torch.randn(3, dtype=torch.bfloat16), torch.arange(6).reshape(2, 3),
            torch.randn(2, dtype=torch.complex128), torch.tensor(2.5), torch.zeros(0, 3),
            torch.randn(4, 4).t()]  # non-contiguous
    for i, v in enumerate(vals):
        w.add(store.Record(index=i, name=f"v{i}", kind="tap", scope="", label="", function="", file="", line=0,
                           op="", shape=tuple(v.shape), dtype=v.dtype, device="cpu", value=v))
    w.close()
    back = load_trace(str(path))
    for v, r in zip(vals, back):
        assert r.value.dtype == v.dtype and torch.equal(r.value, v)


# ---------------------------------------------------------------- links


def test_shard_linked_outside_is_refused(dkt, tmp_path):
    secret = tmp_path / "secret.safetensors"
    from safetensors.torch import save_file

    outside = {k: torch.full((2, 4), 1234.5) for k in ("r000000", "r000001", "r000002")}
    save_file(outside, str(secret))
    shard = dkt / "shard-00000.safetensors"
    os.remove(shard)
    os.symlink(secret, shard)
    msg = _fails(dkt, "shard-00000.safetensors", "symbolic link")
    assert "1234.5" not in msg
    cf = CaptureFile.open(str(dkt))  # metadata is fine; reading any value is refused
    got = []
    with pytest.raises(DiffkitError, match="shard-00000"):
        for rec in cf.records():
            got.append(rec.value)
    assert not any(v is not None and (v == 1234.5).any() for v in got)


def test_shard_hard_to_escape_by_name(dkt):
    _edit_index(dkt, lambda idx: idx["records"][1].update(shard="../../etc/passwd"))
    _fails(dkt, "points outside the capture", "record 1", "shard")
    _edit_index(dkt, lambda idx: idx["records"][1].update(shard="/etc/passwd"))
    _fails(dkt, "points outside the capture")


def test_index_symlink_is_refused(dkt, tmp_path):
    real = tmp_path / "elsewhere.json"
    os.replace(dkt / "index.json", real)
    os.symlink(real, dkt / "index.json")
    _fails(dkt, "index.json", "symbolic link")


def test_fifo_member_is_refused_without_hanging(dkt):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no FIFOs here")
    os.remove(dkt / "index.json")
    os.mkfifo(dkt / "index.json")
    _fails(dkt, "not a regular file")


def test_journal_symlink_of_unfinished_capture_is_refused(dkt, tmp_path):
    secret = tmp_path / "secret.jsonl"
    secret.write_text("hello\n")
    os.remove(dkt / "records.jsonl")
    os.symlink(secret, dkt / "records.jsonl")
    _edit_index(dkt, lambda idx: idx.update(complete=False))
    _fails(dkt, "records.jsonl", "symbolic link")


@pytest.mark.parametrize("planted", ["records.jsonl", "index.json.tmp", "index.json", "shard-00000.safetensors.tmp",
                                     "params.safetensors.tmp"])
def test_writer_does_not_write_through_planted_links(tmp_path, planted):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    path = tmp_path / "run.dkt"
    path.mkdir()
    os.symlink(victim, path / planted)
    w = CaptureWriter(str(path))
    model = _model()
    w.add_parameters(dict(model.named_parameters()))
    for rec in _trace(model):
        w.add(rec)
    w.close()
    assert victim.read_text() == "precious"
    assert not any(os.path.islink(path / f) for f in os.listdir(path))
    assert len(load_trace(str(path))) == 3 and set(CaptureFile.open(str(path)).parameters()) == {"0.weight", "0.bias"}


# ---------------------------------------------------------------- hostile JSON


def test_deep_json_is_an_error_not_a_recursion_error(dkt):
    (dkt / "index.json").write_text("[" * 200_000 + "]" * 200_000)
    _fails(dkt, "index.json", "deeper")
    (dkt / "index.json").write_text('{"format": "diffkit-capture", "version": 2, "records": [], "info": '
                                    + "[" * 200_000 + "]" * 200_000 + "}")
    _fails(dkt, "index.json")


def test_deep_but_parseable_info_is_refused(dkt):
    deep: list = []
    for _ in range(200):
        deep = [deep]
    _edit_index(dkt, lambda idx: idx.update(info={"x": deep}))
    _fails(dkt, "info", "deeper")


def test_oversized_index_is_refused(dkt, monkeypatch):
    monkeypatch.setattr(store, "MAX_INDEX_BYTES", 100)
    _fails(dkt, "index.json", "MiB")


def test_not_utf8(dkt):
    (dkt / "index.json").write_bytes(b'{"format": "\xff\xfe"}')
    _fails(dkt, "UTF-8")


@pytest.mark.parametrize("edit,words", [
    (lambda idx: idx.update(error="boom"), ["'error'"]),
    (lambda idx: idx.update(error={"type": 5}), ["error.type"]),
    (lambda idx: idx.update(error={"line": "12"}), ["error.line"]),
    (lambda idx: idx.update(records={"a": 1}), ["'records'"]),
    (lambda idx: idx.update(records=None), ["'records'"]),
    (lambda idx: idx.update(version="2"), ["version"]),
    (lambda idx: idx.update(version=99), ["version"]),
    (lambda idx: idx.update(complete="yes"), ["'complete'"]),
    (lambda idx: idx.update(side=[1]), ["'side'"]),
    (lambda idx: idx.update(info=[1, 2]), ["'info'"]),
    (lambda idx: idx.update(parameters="../x.safetensors"), ["'parameters'"]),
    (lambda idx: idx["records"].__setitem__(1, "a string"), ["record 1", "not an object"]),
    (lambda idx: idx["records"].__setitem__(1, [1, 2]), ["record 1", "not an object"]),
])
def test_malformed_index(dkt, edit, words):
    _edit_index(dkt, edit)
    _fails(dkt, "index.json", *words)


@pytest.mark.parametrize("fld,bad", [
    ("index", -1), ("index", 10 ** 30), ("index", "1"), ("index", True), ("index", 5),
    ("name", 5), ("name", None), ("kind", ["module"]), ("scope", {"a": 1}), ("label", 1.5), ("function", True),
    ("file", 3), ("op", []), ("device", 0), ("name", "x" * (store.MAX_STR + 1)),
    ("line", "12"), ("line", "12.0"), ("line", 1.0), ("line", -3), ("line", None), ("line", 2 ** 40),
    ("shape", "2,4"), ("shape", [2, "4"]), ("shape", [2, -4]), ("shape", [2, 4.0]), ("shape", [[2], 4]),
    ("shape", [1] * 100), ("shape", None),
    ("dtype", "float33"), ("dtype", 5), ("dtype", None),
    ("aliases", "a"), ("aliases", [1]), ("aliases", {"a": 1}),
    ("is_output", "yes"), ("rebound", 1),
    ("inputs", [7]), ("inputs", [-1]), ("inputs", ["0"]), ("inputs", 0), ("inputs", [10 ** 20]),
    ("params", "0.weight"), ("params", [3]),
    ("key", 5), ("key", ""), ("key", "__metadata__"),
    ("shard", 5), ("shard", "shard/../x.safetensors"), ("shard", ".."), ("shard", "index.json"),
])
def test_wrong_typed_record_field(dkt, fld, bad):
    _edit_index(dkt, lambda idx: idx["records"][1].__setitem__(fld, bad))
    msg = _fails(dkt, "index.json", "record 1", f"'{fld}'")
    assert "Traceback" not in msg


@pytest.mark.parametrize("fld", ["index", "name", "kind", "line", "shape", "dtype"])
def test_missing_record_field(dkt, fld):
    _edit_index(dkt, lambda idx: idx["records"][1].pop(fld))
    _fails(dkt, "record 1", f"'{fld}'", "missing")


def test_too_many_records(dkt, monkeypatch):
    monkeypatch.setattr(store, "MAX_RECORDS", 2)
    _fails(dkt, "more than 2")


# ---------------------------------------------------------------- shards lying about their contents


def _rewrite_shard(path, header_edit):
    import struct

    shard = path / "shard-00000.safetensors"
    data = shard.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    hdr = json.loads(data[8:8 + n])
    header_edit(hdr)
    raw = json.dumps(hdr).encode()
    raw += b" " * (-len(raw) % 8)
    shard.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


@pytest.mark.parametrize("edit", [
    lambda h: h["r000001"].update(data_offsets=[0, 10 ** 12]),
    lambda h: h["r000001"].update(data_offsets=[40, 8]),
    lambda h: h["r000001"].update(dtype="F99"),
    lambda h: h["r000001"].update(shape="2,4"),
    lambda h: h.__setitem__("r000001", "x"),
])
def test_shard_header_lies(dkt, edit):
    _rewrite_shard(dkt, edit)
    _fails(dkt, "shard-00000", "truncated or corrupt", "record 1")


def test_shard_header_length_huge(dkt):
    shard = dkt / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = (2 ** 63).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    _fails(dkt, "shard-00000", "truncated or corrupt")


def test_shard_key_missing(dkt):
    _edit_index(dkt, lambda idx: idx["records"][1].update(key="r999999"))
    _fails(dkt, "do not belong together", "r999999")


# ---------------------------------------------------------------- unfinished captures (the journal)


def _unfinished(path, journal_lines):
    _edit_index(path, lambda idx: idx.update(complete=False, records=idx["records"][:1]))
    (path / "records.jsonl").write_text("".join(line + "\n" for line in journal_lines))


def test_recover_from_journal(dkt):
    lines = (dkt / "records.jsonl").read_text().splitlines()
    _unfinished(dkt, lines + ['{"index": 3, "na'])  # a torn last line ends it
    back = load_trace(str(dkt))
    # (the Sequential's last module is the output: named `1`, as its path says, with `output` an alias)
    assert [r.name for r in back] == ["input[0]", "0", "1"] and back[2].value is not None
    assert back[2].is_output and "output" in back[2].aliases
    assert store._recover_journal(str(dkt), [])[0][1]["name"] == "0"


def test_recover_validates_the_journal(dkt):
    lines = (dkt / "records.jsonl").read_text().splitlines()
    bad = json.loads(lines[1])
    bad["shape"] = "2,4"
    _unfinished(dkt, [lines[0], json.dumps(bad), lines[2]])
    _fails(dkt, "records.jsonl line 2", "record 1", "'shape'")
    _unfinished(dkt, [lines[0], json.dumps({**bad, "index": "1"}), lines[2]])
    _fails(dkt, "records.jsonl line 2", "'index'")
    _unfinished(dkt, [lines[0], '"just a string"', lines[2]])
    _fails(dkt, "records.jsonl line 2", "not a record")
    _unfinished(dkt, [lines[0], "[" * 200_000 + "]" * 200_000])  # unreadable: the journal ends there
    assert len(load_trace(str(dkt))) == 1


# ---------------------------------------------------------------- version 2: info, parameters, params


def test_info_and_parameters_round_trip(tmp_path):
    model = _model()
    model[0].register_buffer("scale", torch.tensor([2.0, 3.0]))
    info = {"source": "/x/ref.py", "class": "Model", "seed": 42, "init_inputs": [4, [1.5, None], {"k": "v"}],
            "device": "cpu", "dtype": "float32", "options": {"no_grad": True}}
    path = tmp_path / "p.dkt"
    w = CaptureWriter(str(path), side="reference")
    w.set_info(info)
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    w.add_parameters(named)
    for rec in _trace(model):
        w.add(rec)
    w.close()
    cf = CaptureFile.open(str(path))
    assert cf.info == info
    params = cf.parameters()
    assert list(params) == list(named)
    for k, v in named.items():
        assert torch.equal(params[k], v.detach()) and not params[k].requires_grad
    from safetensors.torch import load_file

    assert set(load_file(str(path / "params.safetensors"))) == set(named)


def test_info_must_be_json(tmp_path):
    w = CaptureWriter(str(tmp_path / "i.dkt"))
    with pytest.raises(ValueError):
        w.set_info({"t": torch.zeros(1)})
    with pytest.raises(ValueError):
        w.set_info([1, 2])
    with pytest.raises(ValueError):
        w.set_info({1: "a"})
    with pytest.raises(ValueError):
        w.add_parameters({"w": "not a tensor"})
    w.close()
    assert CaptureFile.open(str(tmp_path / "i.dkt")).info == {}


def test_parameters_absent_is_empty(dkt):
    cf = CaptureFile.open(str(dkt))
    assert cf.parameters() == {} and cf.info == {}


def test_parameters_file_refused_when_linked_or_corrupt(tmp_path):
    path = tmp_path / "p.dkt"
    w = CaptureWriter(str(path))
    w.add_parameters(dict(_model().named_parameters()))
    w.close()
    real = tmp_path / "real.safetensors"
    os.replace(path / "params.safetensors", real)
    os.symlink(real, path / "params.safetensors")
    with pytest.raises(DiffkitError, match="params.safetensors.*symbolic link"):
        CaptureFile.open(str(path)).parameters()
    os.remove(path / "params.safetensors")
    with pytest.raises(DiffkitError, match="missing"):
        CaptureFile.open(str(path)).parameters()
    (path / "params.safetensors").write_bytes(real.read_bytes()[:60])
    with pytest.raises(DiffkitError, match="truncated or corrupt"):
        CaptureFile.open(str(path)).parameters()


def test_record_params_written_and_read(tmp_path):
    path = tmp_path / "r.dkt"
    trace = _trace()
    for rec in trace:
        object.__setattr__(rec, "params", ["0.weight", "0.bias"] if rec.name == "0" else [])
    save_trace(trace, str(path))
    cf = CaptureFile.open(str(path))
    assert [m["params"] for m in cf.index["records"]] == [[], ["0.weight", "0.bias"], []]
    recs = list(cf.records())
    if "params" in {f.name for f in __import__("dataclasses").fields(store.Record)}:
        assert recs[1].params == ["0.weight", "0.bias"]


def test_version_1_capture_still_loads(tmp_path, monkeypatch):
    path = tmp_path / "v1.dkt"
    monkeypatch.setattr(store, "VERSION", 1)
    trace = _trace()
    save_trace(trace, str(path))
    monkeypatch.undo()
    # exactly what version 1 wrote: no info, no parameters, no per-record params
    idx = json.loads((path / "index.json").read_text())
    assert idx["version"] == 1
    for k in ("info", "parameters"):
        idx.pop(k)
    for m in idx["records"]:
        m.pop("params")
    (path / "index.json").write_text(json.dumps(idx))
    cf = CaptureFile.open(str(path))
    assert cf.info == {} and cf.parameters() == {}
    back = cf.load()
    assert [r.name for r in back] == [r.name for r in trace]
    assert all(torch.equal(a.value, b.value) for a, b in zip(trace, back))


def test_error_round_trip(tmp_path):
    model = _model()
    x = torch.randn(2, 5)  # wrong width: the forward raises
    with pytest.raises(RuntimeError):
        with capture(model, inputs=(x,)) as trace:
            model(x)
    save_trace(trace, str(tmp_path / "e.dkt"))
    back = load_trace(str(tmp_path / "e.dkt"))
    assert back.error is not None and back.error.type == "RuntimeError" and back.error.traceback
