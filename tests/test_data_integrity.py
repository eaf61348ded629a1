"""flashkd.data on damaged files, concurrent and killed writers, failed overwrites and resumed writes.

Every damage to a target directory must be refused with a TargetsError naming the file, or read back
identically; a write is all or nothing, whatever stops it."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from flashkd.data import TargetsError, TopKTargets, write_topk_targets

V, K, H = 50, 4, 16
LENGTHS = {"a": 3, "b": 0, "c": 5, "d": 2, "e": 7, "f": 1}
SHARD_BYTES = 100  # 4 slots x 8 bytes = 32 bytes a position: shards a+b, c, d, e, f
FILES = ["index.json"] + [f"shard-{i:05d}.safetensors" for i in range(5)]
HYPOTHESIS = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def teacher(seed=0):
    """Hidden states and head weights on a grid of multiples of 1/32: every logit is exact in fp32, so a
    write gives the same bytes in any process and with any thread count."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-8, 9, (V, H), generator=g) / 8
    hidden = {key: torch.randint(-8, 9, (n, H), generator=g) / 4 for key, n in LENGTHS.items()}
    return w, hidden


def write(path, seed=0, *, stop_after=None, lazy_calls=None, **options):
    """write_topk_targets over teacher(seed); stop_after=n raises after the n-th example; lazy_calls, a
    list, gets the keys whose hidden states were asked for (they are passed as callables)."""
    w, hidden = teacher(seed)

    def examples():
        for i, (key, h) in enumerate(hidden.items()):
            if i == stop_after:
                raise RuntimeError("stopped")
            if lazy_calls is None:
                yield key, h
            else:
                yield key, lambda key=key, h=h: lazy_calls.append(key) or h

    options = {"shard_bytes": SHARD_BYTES, "temperature": 1.5, **options}
    return write_topk_targets(path, examples(), w, K, **options)


def files(path):
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


def contents(targets):
    return {key: targets[key] for key in targets}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)


def seal(index):
    """index.json's bytes with the digest the format specifies (computed here, not with flashkd's code)."""
    body = json.dumps({**index, "sha256": "0" * 64})
    return body.replace("0" * 64, hashlib.sha256(body.encode()).hexdigest()).encode()


def siblings(path):
    return sorted(p.name for p in Path(path).parent.iterdir() if p.name.startswith(f".{Path(path).name}."))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "t"
    targets = write(path)
    return path, files(path), contents(targets)


@pytest.fixture
def copy(reference, tmp_path):
    shutil.copytree(reference[0], tmp_path / "t")
    return tmp_path / "t"


def test_layout(reference):
    path, raw, _ = reference
    index = json.loads(raw["index.json"])
    assert list(raw) == FILES and index["version"] == 2
    assert [s["file"] for s in index["shards"]] == FILES[1:]
    assert [index["examples"][key]["shard"] for key in LENGTHS] == [0, 0, 1, 2, 3, 4]
    for entry in index["shards"]:
        assert entry["bytes"] == len(raw[entry["file"]]) and entry["sha256"] == hashlib.sha256(raw[entry["file"]]).hexdigest()
    zeroed = raw["index.json"].replace(index["sha256"].encode(), b"0" * 64)
    assert hashlib.sha256(zeroed).hexdigest() == index["sha256"]


def test_index_in_another_layout_is_read(copy, reference):
    """The digest rule needs no particular layout: an index written here, on one line, reads the same."""
    (copy / "index.json").write_bytes(seal(index_of(copy)))
    assert b"\n" not in (copy / "index.json").read_bytes()
    assert same(contents(TopKTargets(copy)), reference[2])


# Damaged files, one case each.


def tensor_offset(shard: bytes, name: str) -> int:
    n = int.from_bytes(shard[:8], "little")
    return 8 + n + json.loads(shard[8:8 + n])[name]["data_offsets"][0]


def test_flipped_id_byte_is_refused(copy, reference):
    shard = bytearray((copy / FILES[1]).read_bytes())
    shard[tensor_offset(shard, "a.ids") + 3] ^= 0x40  # id 2 of row 0 becomes 2 + 2^30
    (copy / FILES[1]).write_bytes(shard)
    with pytest.raises(TargetsError, match=rf"{FILES[1]}: expected SHA-256 .* the file changed or is damaged"):
        TopKTargets(copy)["a"]
    targets = TopKTargets(copy, check_digests=False)  # without the digest the ids are still checked
    with pytest.raises(TargetsError, match=rf"{FILES[1]}: a\.ids: expected ids in \[-1, 50\) .*got 10737418\d\d"):
        targets["a"]
    assert same({"c": targets["c"]}, {"c": reference[2]["c"]})  # other shards are unaffected
    with pytest.raises(TargetsError, match="SHA-256"):
        targets.verify()


def test_out_of_range_logprob_is_refused(copy):
    shard = bytearray((copy / FILES[2]).read_bytes())
    shard[tensor_offset(shard, "c.logprobs") + 3] ^= 0x80  # the sign bit: log p > 0
    (copy / FILES[2]).write_bytes(shard)
    with pytest.raises(TargetsError, match=rf"{FILES[2]}: c\.logprobs: expected log-probs <= 0"):
        TopKTargets(copy, check_digests=False)["c"]


@pytest.mark.parametrize("check_digests", [True, False])
def test_truncated_shard_is_refused_not_a_safetensors_error(copy, check_digests):
    shard = (copy / FILES[3]).read_bytes()
    (copy / FILES[3]).write_bytes(shard[:-5])
    with pytest.raises(TargetsError, match=rf"{FILES[3]}: expected {len(shard)} bytes .*got {len(shard) - 5}: the file is truncated"):
        TopKTargets(copy, check_digests=check_digests)


@pytest.mark.parametrize("at", [0, 9, 20])
def test_damaged_shard_header_is_a_targets_error(copy, at):
    shard = bytearray((copy / FILES[1]).read_bytes())
    shard[at] ^= 0x22  # the header's length, its opening brace, a name
    (copy / FILES[1]).write_bytes(shard)
    targets = TopKTargets(copy, check_digests=False)
    with pytest.raises(TargetsError, match=FILES[1]):
        targets["a"]


def test_shard_with_other_tensors_is_refused(copy):
    """A shard that is a valid safetensors file of the right size, with other contents: another shard's."""
    index = json.loads((copy / "index.json").read_text())
    shutil.copy(copy / FILES[1], copy / FILES[5])
    index["shards"][4]["bytes"] = (copy / FILES[5]).stat().st_size
    (copy / "index.json").write_bytes(seal({k: v for k, v in index.items() if k != "sha256"}))
    with pytest.raises(TargetsError, match=rf"{FILES[5]}: expected SHA-256"):
        TopKTargets(copy)["f"]
    with pytest.raises(TargetsError, match=rf"{FILES[5]}: a\.ids: expected no such tensor \(from the index\), got shape \[3, 4\] I32"):
        TopKTargets(copy, check_digests=False)["f"]


def test_shard_symlink_is_refused(copy, tmp_path):
    outside = tmp_path / "outside.safetensors"
    shutil.copy(copy / FILES[2], outside)  # the very same bytes: refused for being a link
    (copy / FILES[2]).unlink()
    (copy / FILES[2]).symlink_to(outside)
    with pytest.raises(TargetsError, match=rf"{FILES[2]}: expected a regular file, got a symbolic link"):
        TopKTargets(copy)
    (copy / "index.json").rename(tmp_path / "index.json")
    (copy / "index.json").symlink_to(tmp_path / "index.json")
    with pytest.raises(TargetsError, match=r"index.json: expected a regular file, got a symbolic link"):
        TopKTargets(copy)


def test_an_index_that_is_a_fifo_or_a_directory_is_refused_at_once(copy):
    """A FIFO was opened in blocking mode before the regular-file check: TopKTargets waited forever for
    a writer. A directory gave a raw IsADirectoryError naming file descriptor 3."""
    import threading

    index = copy / "index.json"
    index.unlink()
    os.mkfifo(index)
    got = []

    def open_targets():
        try:
            TopKTargets(copy)
        except Exception as e:  # noqa: BLE001
            got.append(e)

    reader = threading.Thread(target=open_targets, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # blocked in open(): a writer that writes nothing lets it go, then the test fails
        os.close(os.open(index, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail("TopKTargets blocked on an index.json that is a FIFO")
    assert len(got) == 1 and isinstance(got[0], TargetsError), got
    assert "index.json: expected a regular file, got a FIFO" in str(got[0])
    index.unlink()
    index.mkdir()
    with pytest.raises(TargetsError, match=r"index.json: expected a regular file, got a directory"):
        TopKTargets(copy)


def test_a_shard_or_index_that_is_not_a_regular_file_is_named_for_what_it_is(copy, monkeypatch):
    """A shard that is a FIFO was "a directory or device"; an index.json that is a socket was "No such
    device or address" (the errno's text of opening it)."""
    import socket

    shard = copy / FILES[3]
    shard.unlink()
    os.mkfifo(shard)
    with pytest.raises(TargetsError, match=rf"{FILES[3]}: expected a regular file, got a FIFO$"):
        TopKTargets(copy)
    shard.unlink()
    shard.mkdir()
    with pytest.raises(TargetsError, match=rf"{FILES[3]}: expected a regular file, got a directory$"):
        TopKTargets(copy)
    (copy / "index.json").unlink()
    monkeypatch.chdir(copy)  # a short path: a socket's is limited to ~108 bytes
    with socket.socket(socket.AF_UNIX) as server:
        server.bind("index.json")
        with pytest.raises(TargetsError, match=r"index.json: expected a regular file, got a socket$"):
            TopKTargets(copy)


def test_missing_shard_is_refused(copy):
    (copy / FILES[4]).unlink()
    with pytest.raises(TargetsError, match=rf"{FILES[4]}: expected the shard the index lists, got no such file"):
        TopKTargets(copy)


# index.json: every field strictly, its digest, the JSON itself.


def index_of(path):
    index = json.loads((path / "index.json").read_text())
    del index["sha256"]
    return index


@pytest.mark.parametrize(
    "text,match",
    [
        ('"temperature": Infinity', r"expected strict JSON, got: Infinity is not JSON"),
        ('"temperature": NaN', r"expected strict JSON, got: NaN is not JSON"),
        ('"temperature": -Infinity', r"expected strict JSON, got: -Infinity is not JSON"),
        ('"temperature": 1e999', r"expected strict JSON, got: number 1e999 out of range"),
        ('"k": 4, "k": 5', r"expected strict JSON, got: duplicate key 'k'"),
        ('"k": 1' + "0" * 5000, r"expected strict JSON, got: .*digits"),
    ],
)
def test_index_json_is_parsed_strictly(copy, text, match):
    raw = (copy / "index.json").read_text()
    field = text.split(":")[0]
    start = raw.index(field + ":")
    end = raw.index(",", start)
    (copy / "index.json").write_text(raw[:start] + text + raw[end:])
    with pytest.raises(TargetsError, match=r"index.json: " + match):
        TopKTargets(copy)


def test_deeply_nested_index_is_refused(copy):
    (copy / "index.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TargetsError, match=r"index.json: expected JSON a few levels deep, got a document nested too deeply"):
        TopKTargets(copy)
    (copy / "index.json").write_bytes(b'{"format": "\xff"}')
    with pytest.raises(TargetsError, match=r"index.json: expected strict JSON, got: 'utf-8' codec"):
        TopKTargets(copy)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda i: i.update(version=True), r"version: expected 2 .*got True"),
        (lambda i: i.update(version=1), r"version: expected 2 .*version 1, without digests, must be written again.*got 1"),
        (lambda i: i.update(version=2.0), r"version: expected 2 .*got 2.0"),
        (lambda i: i.update(format="other"), r"format: expected 'flashkd.topk', got 'other'"),
        (lambda i: i.update(k=0), r"k: expected an int in \[1, 50\] \(vocab_size\), got 0"),
        (lambda i: i.update(k=4.0), r"k: expected an int in \[1, 50\]"),
        (lambda i: i.update(k=51), r"k: expected an int in \[1, 50\]"),
        (lambda i: i.update(vocab_size=True), r"vocab_size: expected an int in \[1, 2147483648\), got True"),
        (lambda i: i.update(vocab_size=2**31), r"vocab_size: expected an int in \[1, 2147483648\)"),
        (lambda i: i.update(temperature=True), r"temperature: expected a finite number > 0, got True"),
        (lambda i: i.update(temperature=0), r"temperature: expected a finite number > 0, got 0"),
        (lambda i: i.update(temperature="1.5"), r"temperature: expected a finite number > 0, got '1.5'"),
        # an int too large for a float (no run of zeros in it: `seal` writes the digest over one)
        (lambda i: i.update(temperature=3**700), r"temperature: expected a finite number > 0, got \d{300}"),
        (lambda i: i.update(logprob_dtype="int8"), r"logprob_dtype: expected one of 'float32'"),
        (lambda i: i.update(logprob_dtype=["float32"]), r"logprob_dtype: expected one of 'float32'"),
        (lambda i: i.update(teacher_description=7), r"teacher_description: expected a string or null, got 7"),
        (lambda i: i.update(shards={}), r"shards: expected a list of \{file, bytes, sha256\}"),
        (lambda i: i["shards"][1].update(file="shard-0000١.safetensors"), r"shards\[1\]: expected \{\"file\": 'shard-00001.safetensors'"),
        (lambda i: i["shards"][1].update(file="../shard-00001.safetensors"), r"shards\[1\]: expected \{\"file\": 'shard-00001.safetensors'"),
        (lambda i: i["shards"][1].update(file="/etc/passwd"), r"shards\[1\]: expected"),
        (lambda i: i["shards"][1].update(file="shard-00002.safetensors"), r"shards\[1\]: expected"),
        (lambda i: i["shards"][1].update(bytes=-1), r"shards\[1\]: expected"),
        (lambda i: i["shards"][1].update(bytes=True), r"shards\[1\]: expected"),
        (lambda i: i["shards"][1].update(sha256="AB" * 32), r"shards\[1\]: expected"),
        (lambda i: i["shards"][1].update(extra=1), r"shards\[1\]: expected"),
        (lambda i: i["shards"].append(i["shards"][0]), r"shards\[5\]: expected"),
        (lambda i: i.update(examples=[]), r"examples: expected an object key -> \{shard, length\}"),
        (lambda i: i["examples"].update(a={"shard": 5, "length": 3}), r"examples: 'a': expected .*\"shard\": 0\.\.4"),
        (lambda i: i["examples"].update(a={"shard": True, "length": 3}), r"examples: 'a': expected"),
        (lambda i: i["examples"].update(a={"shard": 0, "length": 3.0}), r"examples: 'a': expected"),
        (lambda i: i["examples"].update(a={"shard": 0, "length": -1}), r"examples: 'a': expected"),
        (lambda i: i["examples"].update(a={"shard": 0}), r"examples: 'a': expected"),
        (lambda i: i["examples"].update({"a b": {"shard": 0, "length": 3}}), r"examples: 'a b': expected a key of 1 to 200"),
        (lambda i: i.update(extra=None), r"expected the fields format, .*; missing \[\], unexpected \['extra'\]"),
        (lambda i: i.pop("k"), r"expected the fields .*; missing \['k'\], unexpected \[\]"),
    ],
)
def test_index_fields_are_checked(copy, edit, match):
    index = index_of(copy)
    edit(index)
    (copy / "index.json").write_bytes(seal(index))
    with pytest.raises(TargetsError, match=r"index.json: " + match):
        TopKTargets(copy)


def test_index_not_an_object_is_refused(copy):
    (copy / "index.json").write_text("[1, 2]")
    with pytest.raises(TargetsError, match=r"index.json: expected a JSON object, got list"):
        TopKTargets(copy)


def test_changed_index_is_refused(copy):
    """A valid index whose digest no longer matches: a hand edit, a damaged byte."""
    raw = (copy / "index.json").read_text()
    (copy / "index.json").write_text(raw.replace('"teacher_description": null', '"teacher_description": "x"'))
    with pytest.raises(TargetsError, match=r"index.json: sha256: expected the digest of the file \([0-9a-f]{64}\), got .*changed or is damaged"):
        TopKTargets(copy)
    (copy / "index.json").write_text(raw.replace("\n", "\n "))  # whitespace is covered too
    with pytest.raises(TargetsError, match=r"sha256: expected the digest"):
        TopKTargets(copy)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda i: i["examples"].update(a={"shard": 0, "length": 4}), r"a\.ids: expected shape \[4, 4\] I32 \(from the index\), got shape \[3, 4\] I32"),
        (lambda i: i["examples"].pop("b"), r"b\.ids: expected no such tensor \(from the index\), got shape \[0, 4\] I32"),
        (lambda i: i["examples"].update(b={"shard": 1, "length": 0}), r"b\.ids: expected no such tensor"),
        (lambda i: i.update(k=5), r"a\.ids: expected shape \[3, 5\] I32"),
        (lambda i: i.update(logprob_dtype="float16"), r"a\.logprobs: expected shape \[3, 4\] F16 \(from the index\), got shape \[3, 4\] F32"),
    ],
)
def test_index_that_disagrees_with_its_shard_is_refused(copy, edit, match):
    index = index_of(copy)
    edit(index)
    (copy / "index.json").write_bytes(seal(index))
    with pytest.raises(TargetsError, match=rf"{FILES[1]}: " + match):
        TopKTargets(copy).verify()


def test_ids_beyond_vocab_size_are_refused(copy):
    index = index_of(copy)
    index["vocab_size"] = 10  # the ids go up to 49
    (copy / "index.json").write_bytes(seal(index))
    with pytest.raises(TargetsError, match=rf"{FILES[1]}: a\.ids: expected ids in \[-1, 10\) \(vocab_size; -1 an unused slot\)"):
        TopKTargets(copy)["a"]


def sealed(path, rows, dtype=torch.float32):
    """A directory of the format holding `rows` (key -> (ids, logprobs)) in one shard, its digests right:
    targets written by another tool, whose values only the per-example checks can refuse."""
    import safetensors.torch

    path.mkdir()
    tensors = {}
    for key, (ids, lp) in rows.items():
        tensors[f"{key}.ids"], tensors[f"{key}.logprobs"] = ids.to(torch.int32), lp.to(dtype)
    safetensors.torch.save_file(tensors, path / FILES[1], metadata={"format": "flashkd.topk/2"})
    raw = (path / FILES[1]).read_bytes()
    (path / "index.json").write_bytes(seal({
        "format": "flashkd.topk", "version": 2, "k": K, "temperature": 1.0, "vocab_size": V,
        "logprob_dtype": str(dtype).removeprefix("torch."), "teacher_description": None,
        "shards": [{"file": FILES[1], "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}],
        "examples": {key: {"shard": 0, "length": ids.shape[0]} for key, (ids, _) in rows.items()}}))
    return TopKTargets(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_that_are_no_top_k_of_a_distribution_are_refused(tmp_path, dtype):
    """Repeated ids in a row, or probabilities summing past 1, were served: the loss, unchecked on a GPU,
    then counted an id twice or renormalised the bucket in silence."""
    p = torch.tensor([[0.5, 0.2, 0.1, 0.05], [0.4, 0.4, 0.1, 0.1]])
    ids = torch.tensor([[3, 7, 9, 1], [5, 6, 8, 2]])
    cases = {"dup": (torch.tensor([[3, 7, 9, 1], [5, 6, 5, 2]]), p.log()),
             "mass": (ids, torch.tensor([[0.5, 0.2, 0.1, 0.05], [0.6, 0.4, 0.1, 0.1]]).log())}
    targets = sealed(tmp_path / "t", {"ok": (ids, p.log()), **cases}, dtype)
    with pytest.raises(TargetsError, match=rf"{FILES[1]}: dup\.ids: expected distinct ids in a row \(the top k\), "
                                           r"got id 5 twice in row 1"):
        targets["dup"]
    with pytest.raises(TargetsError, match=rf"{FILES[1]}: mass\.logprobs: expected probabilities summing to at most 1 "
                                           r"in a row .*got 1\.(2|19)\d* in row 1"):
        targets["mass"]
    assert torch.allclose(targets["ok"][1].exp(), p, rtol=2**-5)  # bf16: |log p|·2^-8
    # unused slots (-1, -inf) repeat, and a row may sum to 1 up to the rounding of its dtype
    full = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).log().to(dtype)
    again = sealed(tmp_path / "u", {"pad": (torch.tensor([[4, -1, 6, -1]]), torch.tensor([[-0.5, -torch.inf, -1.0, -torch.inf]])),
                                    "full": (torch.tensor([[1, 2, 3, 4]]), full)}, dtype)
    again.verify()


def test_a_shard_replaced_between_its_check_and_its_open_is_refused(copy, tmp_path, monkeypatch):
    """The digest was taken from one open of the path and the tensors read from another: a shard renamed
    over it in between (another write's) was served as the one checked."""
    import flashkd.data

    other = tmp_path / "other"
    write(other, seed=1)
    digest = flashkd.data._file_sha256

    def then_replace(fd):
        got = digest(fd)
        shutil.copy(other / FILES[2], copy / "new")
        os.replace(copy / "new", copy / FILES[2])
        return got

    monkeypatch.setattr(flashkd.data, "_file_sha256", then_replace)
    with pytest.raises(TargetsError, match=rf"{FILES[2]}: expected the shard that was checked, got another file at its "
                                           "path: it was replaced while it was opened"):
        TopKTargets(copy)["c"]


@pytest.mark.parametrize("check_digests", [True, False])
def test_targets_replaced_under_an_open_reader_are_refused(copy, reference, check_digests):
    """An overwrite of the directory (same examples, another teacher: shards of the same sizes and
    headers) after a reader read its index: without digests the reader served the new shards as the
    old index's, two teachers mixed in one epoch."""
    import pickle

    targets = TopKTargets(copy, check_digests=check_digests)
    early = TopKTargets(copy, check_digests=check_digests)
    assert same({"a": targets["a"]}, {"a": reference[2]["a"]})
    early.verify() if check_digests else contents(early)  # every shard open before the overwrite
    write(copy, seed=1, overwrite=True)
    for reader in (targets, pickle.loads(pickle.dumps(targets))):  # a DataLoader worker's copy too
        with pytest.raises(TargetsError, match=r"index\.json: expected the index this reader opened, got another "
                                               r"file: the targets were replaced \(an overwrite\?\) since"):
            reader["c"]
    assert same({"a": targets["a"]}, {"a": reference[2]["a"]})  # its shard opened before: the old targets
    assert same(contents(early), reference[2])  # shards opened before: the old targets, whole
    assert not same(contents(TopKTargets(copy)), reference[2])  # (the new ones differ)


# Damage at random: Hypothesis.


@st.composite
def damage(draw):
    name = draw(st.sampled_from(FILES))
    op = draw(st.sampled_from(["byte", "flip", "truncate", "append", "delete", "swap", "link"]))
    return name, op, draw(st.integers(0, 2**32)), draw(st.integers(0, 255)), draw(st.binary(min_size=1, max_size=16))


def apply(path, name, op, where, value, extra):
    file = path / name
    data = bytearray(file.read_bytes())
    at = where % len(data)
    if op == "byte":
        data[at] = value
    elif op == "flip":
        data[at] ^= 1 << (value % 8)
    elif op == "truncate":
        data = data[:at]
    elif op == "append":
        data += extra
    elif op == "swap":  # another file of the directory in its place (as written: an earlier damage may have deleted it)
        other = path.parent / "original" / FILES[(FILES.index(name) + 1 + value % (len(FILES) - 1)) % len(FILES)]
        data = bytearray(other.read_bytes())
    file.unlink()
    if op == "delete":
        return True
    if op == "link":
        outside = path.parent / f"outside-{name}"
        outside.write_bytes(data)
        file.symlink_to(outside)
    else:
        file.write_bytes(data)
    return op == "link" or bytes(data) != (path.parent / "original" / name).read_bytes()


def read_all(path, check_digests=True):
    targets = TopKTargets(path, check_digests=check_digests)
    if check_digests:
        targets.verify()
    return (targets.k, targets.temperature, targets.vocab_size, targets.logprob_dtype), contents(targets)


@HYPOTHESIS
@given(damages=st.lists(damage(), min_size=1, max_size=2, unique_by=lambda d: d[0]))
@example(damages=[(FILES[3], "delete", 0, 0, b"\x00"), (FILES[4], "swap", 0, 14, b"\x00")])  # swapped in: a deleted file
def test_any_damage_is_refused(reference, damages):
    path, _, want = reference
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "t"
        shutil.copytree(path, copy)
        shutil.copytree(path, Path(tmp) / "original")
        changed = [name for name, *rest in damages if apply(copy, name, *rest)]
        try:
            meta, got = read_all(copy)
        except TargetsError as e:
            assert changed and any(name in str(e) for name in changed), (e, damages)
            event("refused")
        else:
            assert not changed, damages
            event("unchanged, read the same")
            assert meta == (K, 1.5, V, torch.float32) and same(got, want)
        try:  # without digests some damage to values goes unseen, but nothing but a TargetsError comes out
            read_all(copy, check_digests=False)
        except TargetsError:
            pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6) | st.sampled_from(["shard-00000.safetensors", "float16", "a", "0" * 64]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["shard", "length", "file", "a", "x"]), inner, max_size=3),
    max_leaves=5,
)


def places(value):
    """Every (container, key) in a JSON value."""
    if isinstance(value, dict):
        for k in list(value):
            yield value, k
            yield from places(value[k])
    elif isinstance(value, list):
        for i in range(len(value)):
            yield value, i
            yield from places(value[i])


@HYPOTHESIS
@given(where=st.integers(0, 2**16), op=st.sampled_from(["set", "delete", "add"]), value=json_values,
       new_key=st.sampled_from(["zz", "k", "shard", "length", "file", "bytes", "sha256", "a"]))
def test_any_index_edit_is_refused_or_reads_the_same(reference, where, op, value, new_key):
    """An index rewritten with a valid digest (a writer's bug, not damage): the reader never serves other
    tensors than the shards hold for a key, whatever the index says."""
    path, raw, want = reference
    index = json.loads(raw["index.json"])
    del index["sha256"]
    spots = list(places(index))
    container, key = spots[where % len(spots)]
    if op == "set":
        container[key] = value
    elif op == "delete":
        container.pop(key)
    elif isinstance(container, dict):
        container[new_key] = value
    else:
        container.append(value)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "t"
        shutil.copytree(path, copy)
        (copy / "index.json").write_bytes(seal(index))
        try:
            meta, got = read_all(copy)
        except TargetsError as e:
            assert "index.json" in str(e) or "shard-" in str(e)
            event("refused")
        else:  # what may change unseen: metadata the shards do not hold
            assert meta[0] == K and meta[3] == torch.float32 and meta[2] >= V and same(got, want)
            event("accepted, read the same")


# Writers: concurrent, failing, killed, resumed.


def test_two_writers_on_one_directory(tmp_path, reference):
    """The second writer is refused while the first runs; the first's result is its own."""
    out = tmp_path / "t"
    out.mkdir()  # both would see it empty
    w, hidden = teacher()
    refused = []

    def examples():
        for i, (key, h) in enumerate(hidden.items()):
            if i == 3:
                with pytest.raises(ValueError, match=r"out_dir: another write into .* is running \(it holds .*\.t\.flashkd-lock\)"):
                    write(out, seed=1)
                refused.append(True)
            yield key, h

    write_topk_targets(out, examples(), w, K, shard_bytes=SHARD_BYTES, temperature=1.5)
    assert refused and files(out) == reference[1] and siblings(out) == []


def test_what_sits_at_the_lock_path_is_named_and_only_flashkds_lock_file_is_removed(tmp_path, reference):
    """A directory at the lock path gave a raw IsADirectoryError; a regular file or a FIFO the user had
    there was deleted when the write ended."""
    out, lock = tmp_path / "t", tmp_path / ".t.flashkd-lock"
    lock.mkdir()
    with pytest.raises(ValueError, match=rf"^out_dir: expected no file or a lock file at {lock} \(flashkd locks it "
                                         r"while it writes\), got a directory; move it away$"):
        write(out)
    lock.rmdir()
    os.mkfifo(lock)
    with pytest.raises(ValueError, match=r"^out_dir: expected no file or a lock file at .*, got a FIFO; move it away$"):
        write(out)
    lock.unlink()
    lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"^out_dir: .*, got a symbolic link; move it away$"):
        write(out)
    assert not (tmp_path / "elsewhere").exists()
    lock.unlink()
    lock.write_text("the user's\n")  # a regular file: the lock, left as it was
    write(out)
    assert files(out) == reference[1] and lock.read_text() == "the user's\n"
    lock.unlink()
    write(tmp_path / "u", seed=1)  # flashkd's own lock file, made and removed
    assert siblings(tmp_path / "u") == []
    # a writer killed while it held the lock left its file: the next write takes it and removes it
    killed = f"import os; from pathlib import Path; from flashkd import files; " \
             f"held = files.exclusive(Path({str(lock)!r}), 'busy', what='out_dir'); held.__enter__(); os._exit(0)"
    subprocess.run([sys.executable, "-c", killed], check=True, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert lock.is_file()
    write(out, overwrite=True)
    assert not lock.exists()


def test_failed_write_leaves_nothing_and_is_refused_as_unfinished(tmp_path):
    out = tmp_path / "t"
    with pytest.raises(RuntimeError, match="stopped"):
        write(out, stop_after=1)  # before any shard finished: nothing kept
    assert not out.exists() and siblings(out) == []
    with pytest.raises(RuntimeError, match="stopped"):
        write(out, stop_after=4)
    assert not out.exists() and siblings(out) == [".t.flashkd-partial"]
    with pytest.raises(TargetsError, match=r"path: expected a directory with index.json, got .*t \(a write into it did not finish: .*\.t\.flashkd-partial holds its finished shards; finish it with resume=True\)"):
        TopKTargets(out)
    with pytest.raises(TargetsError, match=r"a write that did not finish, and this its build directory"):
        TopKTargets(tmp_path / ".t.flashkd-partial")
    with pytest.raises(ValueError, match=r"out_dir: an earlier write into it did not finish; .*\.t\.flashkd-partial holds its finished shards: pass resume=True"):
        write(out)


def test_failed_overwrite_loses_nothing(tmp_path, reference):
    out = tmp_path / "t"
    write(out, seed=1)
    old, old_contents = files(out), contents(TopKTargets(out))
    with pytest.raises(RuntimeError, match="stopped"):
        write(out, stop_after=4, overwrite=True)
    assert files(out) == old and same(contents(TopKTargets(out)), old_contents)
    write(out, overwrite=True, resume=True)
    assert files(out) == reference[1] and siblings(out) == []
    # a directory named like a shard: refused before anything is written
    (out / "shard-00099.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"out_dir: overwrite=True replaces a directory of targets, but .* also holds 'shard-00099.safetensors' \(a directory\)"):
        write(out, seed=1, overwrite=True)
    (out / "shard-00099.safetensors").rmdir()
    assert files(out) == reference[1] and siblings(out) == []


def test_overwrite_that_fails_in_the_swap_loses_nothing(tmp_path, reference, monkeypatch):
    out = tmp_path / "t"
    write(out, seed=1)
    old = files(out)
    rename = os.rename

    def failing(src, dst):
        if Path(src).name == ".t.flashkd-partial":
            raise OSError(28, "No space left on device")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="No space left"):
        write(out, overwrite=True)
    assert files(out) == old and siblings(out) == [".t.flashkd-partial"]
    monkeypatch.setattr(os, "rename", rename)
    write(out, overwrite=True, resume=True)  # the finished write, swapped in
    assert files(out) == reference[1] and siblings(out) == []


def test_overwrite_replaces(tmp_path, reference):
    out = tmp_path / "t"
    write(out, seed=1)
    write(out, overwrite=True)
    assert files(out) == reference[1] and siblings(out) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    write(empty)
    assert files(empty) == reference[1]


@pytest.mark.parametrize("stop_after", [3, 5])
def test_resume_is_byte_identical(tmp_path, reference, stop_after):
    out = tmp_path / "t"
    with pytest.raises(RuntimeError, match="stopped"):
        write(out, stop_after=stop_after)
    calls = []
    targets = write(out, resume=True, lazy_calls=calls)
    assert files(out) == reference[1] and siblings(out) == []
    # the teacher ran only for the examples of unfinished shards
    assert calls == list(LENGTHS)[2 if stop_after == 3 else 4:]
    assert same(contents(targets), reference[2])


def test_resume_with_nothing_to_resume_is_a_write(tmp_path, reference):
    assert files(write(tmp_path / "t", resume=True).path) == reference[1]


@pytest.mark.parametrize(
    "options,match",
    [
        ({"temperature": 2.0}, r"temperature: resume=True continues the write in .*, made with temperature=1.5; got 2.0"),
        ({"logprob_dtype": torch.float16}, r"logprob_dtype: .*made with logprob_dtype='float32'; got 'float16'"),
        ({"vocab_size": 40}, r"vocab_size: .*made with vocab_size=50; got 40"),
        ({"teacher_description": "other"}, r"teacher_description: .*made with teacher_description=None; got 'other'"),
        ({"shard_bytes": 200}, r"shard_bytes: .*made with shard_bytes=100; got 200"),
        ({"chunk_size": 2}, r"chunk_size: .*made with chunk_size=None; got 2"),
    ],
)
def test_resume_refuses_other_options(tmp_path, options, match):
    out = tmp_path / "t"
    with pytest.raises(RuntimeError):
        write(out, stop_after=4)
    before = files(tmp_path / ".t.flashkd-partial")
    with pytest.raises(ValueError, match=match):
        write(out, resume=True, **options)
    assert files(tmp_path / ".t.flashkd-partial") == before  # refused before anything changed


def test_resume_refuses_other_examples(tmp_path):
    out = tmp_path / "t"
    with pytest.raises(RuntimeError):
        write(out, stop_after=4)
    w, hidden = teacher()
    items = list(hidden.items())
    with pytest.raises(ValueError, match=r"examples: resume=True expects the examples of the interrupted write, in its order: position 1 was 'b' there, got 'c'"):
        write_topk_targets(out, [items[0], items[2], items[1]], w, K, shard_bytes=SHARD_BYTES, temperature=1.5, resume=True)
    with pytest.raises(ValueError, match=r"examples: resume=True expects the examples of the interrupted write: it had finished 3, examples gave 2"):
        write_topk_targets(out, items[:2], w, K, shard_bytes=SHARD_BYTES, temperature=1.5, resume=True)
    with pytest.raises(ValueError, match=r"k: expected an int|k: resume=True"):
        write_topk_targets(out, items, w, K + 1, shard_bytes=SHARD_BYTES, temperature=1.5, resume=True)
    with pytest.raises(ValueError, match=r"teacher_weight: .*made with hidden_size=16; got 8"):
        write_topk_targets(out, items, w[:, :8], K, shard_bytes=SHARD_BYTES, temperature=1.5, resume=True)


def test_resume_checks_the_finished_shards(tmp_path):
    out = tmp_path / "t"
    with pytest.raises(RuntimeError):
        write(out, stop_after=4)
    shard = tmp_path / ".t.flashkd-partial" / FILES[2]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(data)
    with pytest.raises(TargetsError, match=rf"{FILES[2]}: expected SHA-256 .*changed or is damaged"):
        write(out, resume=True)


def test_nan_hidden_states_are_not_written(tmp_path):
    w, hidden = teacher()
    bad = hidden["c"].clone()
    bad[1, 0] = torch.nan
    examples = [("a", hidden["a"]), ("c", bad)]
    with pytest.raises(ValueError, match=r"'c'|teacher_input"):
        write_topk_targets(tmp_path / "t", examples, w, K, shard_bytes=SHARD_BYTES)
    assert not (tmp_path / "t").exists() and siblings(tmp_path / "t") == []


# A writer killed at random points: a child process imports torch once, then forks one writer per
# point, each of which SIGKILLs itself just before its n-th file-system call.

CHILD = r"""
import json, os, random, shutil, signal, sys
import torch
torch.set_num_threads(1)  # nothing threaded before the forks
sys.path.insert(0, sys.argv[2])
from test_data_integrity import write
base, points = sys.argv[1], int(sys.argv[3])
CALLS = ("replace", "rename", "fsync", "unlink", "rmdir", "truncate")
FSYNC = os.fsync

def run(out, point, overwrite):
    pid = os.fork()
    if pid == 0:
        count = [0]
        def wrap(f):
            def call(*args, **kwargs):
                count[0] += 1
                if count[0] == point:
                    os.kill(os.getpid(), signal.SIGKILL)
                # fsync guards against power loss, not against a kill: skipped here, for speed
                return None if f is FSYNC else f(*args, **kwargs)
            return call
        for name in CALLS:
            setattr(os, name, wrap(getattr(os, name)))
        write(out, overwrite=overwrite)
        with open(out + ".calls", "w") as f:
            f.write(str(count[0]))
        os._exit(0)
    return os.waitpid(pid, 0)[1]

os.makedirs(base)
write(os.path.join(base, "old"), seed=1)
first = os.path.join(base, "first", "t")
shutil.copytree(os.path.join(base, "old"), first)
assert run(first, None, True) == 0
total = int(open(first + ".calls").read())
rng = random.Random(int(sys.argv[4]))  # the points: 4 at random (the seed is printed on failure), the last 6
chosen = sorted(set(rng.sample(range(1, total + 1), points) + list(range(total - 5, total + 1))))
report = []
for point in chosen:
    for overwrite in (False, True):
        out = os.path.join(base, f"{point}-{overwrite}", "t")
        if overwrite:
            shutil.copytree(os.path.join(base, "old"), out)
        status = run(out, point, overwrite)
        report.append([out, point, overwrite, os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL])
print(json.dumps({"total": total, "report": report}))
"""


def test_killed_writer_leaves_old_or_new_and_resumes(tmp_path, reference, monkeypatch, seed):
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "runs"), str(Path(__file__).parent), "4", str(seed)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["total"] > 20 and sum(killed for *_, killed in out["report"]) > len(out["report"]) // 2
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # as in the child: kills, not power loss, are tested
    old = files(tmp_path / "runs" / "old")
    assert files(tmp_path / "runs" / "first" / "t") == reference[1]
    seen = set()
    for path, point, overwrite, _ in out["report"]:
        path = Path(path)
        try:
            now = files(path) if (path / "index.json").exists() else None
            TopKTargets(path).verify()
        except TargetsError as e:
            assert "did not finish" in str(e) or "no such directory" in str(e), (point, overwrite, e)
            seen.add("refused")
        else:
            assert now == reference[1] or (overwrite and now == old), (point, overwrite)
            seen.add("new" if now == reference[1] else "old")
        # whatever the kill left, resuming gives the uninterrupted write's bytes
        write(path, overwrite=True, resume=True)
        assert files(path) == reference[1] and siblings(path) == [], (point, overwrite)
    assert seen == {"refused", "new", "old"}


def test_shards_take_the_umask_as_index_json_does(tmp_path):
    """safetensors makes its files 0600: another user who could read index.json then died on a raw
    PermissionError at the first shard."""
    old = os.umask(0o027)
    try:
        write(tmp_path / "t")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "t").iterdir()}
    assert set(modes) == set(FILES) and set(modes.values()) == {0o640}, modes


def test_what_sits_at_the_build_or_aside_path_is_refused_before_any_work(tmp_path):
    """A FIFO at .NAME.flashkd-partial or -old made the writer wait forever in rmtree (the latter after all
    its work); a file or a link there died in a raw NotADirectoryError or OSError."""
    import threading

    out = tmp_path / "t"
    for tag in ("partial", "old"):
        path = tmp_path / f".t.flashkd-{tag}"
        for make, kind in ((os.mkfifo, "a FIFO"), (lambda p: p.write_text("mine"), "a regular file"),
                           (lambda p: p.symlink_to(tmp_path), "a symbolic link")):
            make(path)
            calls, got = [], []

            def run():
                try:
                    write(out, lazy_calls=calls)
                except ValueError as e:
                    got.append(str(e))

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            thread.join(30)
            if thread.is_alive():  # blocked opening the FIFO: a writer lets it go, then the test fails
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                thread.join(10)
                pytest.fail(f"the write waited on a FIFO at {path}")
            assert got == [f"out_dir: expected a directory or nothing at {path} (flashkd builds there), "
                           f"got {kind}; move it away"], got
            assert calls == [] and not out.exists()
            os.unlink(path)


def test_a_shard_that_vanishes_between_the_two_opens_is_a_targets_error(tmp_path, monkeypatch):
    """safetensors opens the file again through torch (UntypedStorage.from_file): a shard removed in between
    (an overwrite by another process) gave torch's raw RuntimeError."""
    write(tmp_path / "t")
    targets = TopKTargets(tmp_path / "t")

    def gone(*args, **kwargs):
        raise RuntimeError("unable to open file <shard> in read-only mode: No such file or directory (2)")

    monkeypatch.setattr(torch.UntypedStorage, "from_file", gone)
    key = next(iter(LENGTHS))
    with pytest.raises(TargetsError, match=r"shard-00000\.safetensors: expected a safetensors file, got: unable to open"):
        targets[key]


def test_paths_and_examples_of_the_wrong_kind_are_named(tmp_path):
    """`examples` an int died in "'int' object is not iterable"; a path of None or 5 in pathlib's own
    TypeError; a NUL in it in os's "embedded null byte"."""
    w, _ = teacher()
    cases = [(lambda: write_topk_targets(tmp_path / "t", 5, w, K), TypeError,
              "examples: expected an iterable of (key, hidden_states) pairs, got int"),
             (lambda: write_topk_targets(None, [], w, K), TypeError, "out_dir: expected a str or os.PathLike path, got NoneType"),
             (lambda: TopKTargets(5), TypeError, "path: expected a str or os.PathLike path, got int"),
             (lambda: TopKTargets(f"{tmp_path}/a\0b"), ValueError, "path: expected a path without NUL characters, got")]
    for call, error, said in cases:
        with pytest.raises(error) as info:
            call()
        assert str(info.value).startswith(said), str(info.value)
    assert list(tmp_path.iterdir()) == []
