"""The on-disk cache of compiled CuTe DSL kernels (`flashkd.backends.cute_cache`): its files, written whole and
checked when read, with a stand-in for CuTe DSL (an object whose export writes bytes, a loader that reads
them back). The real export and load: tests/test_cute_compile.py, where nvidia-cutlass-dsl is installed."""

import json
import os
import threading

import pytest

from flashkd.backends import cute_cache

KEY = ("torch.bfloat16", 2, 256, 4, 132, "tma", 2, (9, 0))


class Compiled:
    """What `cute.compile` returns, as far as the cache uses it."""

    def __init__(self, payload: bytes):
        self.payload = payload

    def export_to_c(self, path, name, prefix):
        with open(os.path.join(path, name + ".o"), "wb") as f:
            f.write(prefix.encode() + b"\n" + self.payload)
        with open(os.path.join(path, name + ".h"), "w") as f:
            f.write("/* header */\n")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHKD_CACHE_DIR", str(tmp_path))
    source = tmp_path / "kernel_source.py"
    source.write_text("# the kernel's code\n")
    loads = []

    def load(obj, prefix):
        data = obj.read_bytes()
        assert data.startswith(prefix.encode() + b"\n")
        loads.append(obj)
        return ("loaded", data[len(prefix) + 1:])

    monkeypatch.setattr(cute_cache, "_load", load)
    return tmp_path, source, loads


def _compile(payload=b"cubin", calls=None):
    def fn():
        if calls is not None:
            calls.append(1)
        return Compiled(payload)
    return fn


def _folder(tmp_path, source):
    return tmp_path / "cute" / cute_cache.name_of(KEY, source)


def test_a_kernel_compiled_once_is_loaded_by_the_next_process(cache):
    tmp_path, source, loads = cache
    calls = []
    fn, how = cute_cache.load_or_compile(KEY, source, _compile(calls=calls))
    assert how == "compiled" and isinstance(fn, Compiled) and calls == [1]
    folder = _folder(tmp_path, source)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["name"] == folder.name and manifest["bytes"] == (folder / "kernel.o").stat().st_size
    assert [p.name for p in (tmp_path / "cute").iterdir()] == [folder.name]  # no temporary folder left
    fn, how = cute_cache.load_or_compile(KEY, source, _compile(calls=calls))
    assert how == "cache" and fn == ("loaded", b"cubin") and calls == [1] and len(loads) == 1


def test_another_variant_toolchain_or_source_is_another_kernel(cache, monkeypatch):
    tmp_path, source, _ = cache
    names = {cute_cache.name_of(KEY, source), cute_cache.name_of(KEY[:-1] + ((10, 0),), source)}
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    names.add(cute_cache.name_of(KEY, source))
    source.write_text("# the kernel's code, changed\n")
    names.add(cute_cache.name_of(KEY, source))
    assert len(names) == 4


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "manifest cut short", "manifest of another",
                                    "no object"])
def test_a_damaged_kernel_is_never_loaded_but_compiled_again_and_replaced(cache, damage):
    tmp_path, source, loads = cache
    cute_cache.load_or_compile(KEY, source, _compile(b"cubin v1"))
    folder = _folder(tmp_path, source)
    obj, manifest = folder / "kernel.o", folder / "manifest.json"
    if damage == "flip a byte":
        data = bytearray(obj.read_bytes())
        data[-1] ^= 1
        obj.write_bytes(bytes(data))
    elif damage == "truncate":
        obj.write_bytes(obj.read_bytes()[:-3])
    elif damage == "manifest cut short":
        manifest.write_text(manifest.read_text()[:20])
    elif damage == "manifest of another":
        m = json.loads(manifest.read_text())
        manifest.write_text(json.dumps(dict(m, name="0" * 40)))
    else:
        obj.unlink()
    calls = []
    with pytest.warns(RuntimeWarning, match="is not used: .*compiling it again"):
        fn, how = cute_cache.load_or_compile(KEY, source, _compile(b"cubin v2", calls))
    assert how == "compiled" and fn.payload == b"cubin v2" and calls == [1] and loads == []
    fn, how = cute_cache.load_or_compile(KEY, source, _compile(b"cubin v3"))
    assert how == "cache" and fn == ("loaded", b"cubin v2")
    assert sorted(p.name for p in (tmp_path / "cute").iterdir()) == [folder.name]


def test_an_interrupted_write_leaves_nothing_that_is_read(cache, monkeypatch):
    tmp_path, source, loads = cache

    class Broken(Compiled):
        def export_to_c(self, path, name, prefix):
            with open(os.path.join(path, name + ".o"), "wb") as f:
                f.write(b"half")
            raise OSError(28, "No space left on device")

    with pytest.warns(RuntimeWarning, match="cannot write the compiled CuTe DSL kernel"):
        fn, how = cute_cache.load_or_compile(KEY, source, lambda: Broken(b""))
    assert how == "compiled" and isinstance(fn, Broken)
    assert list((tmp_path / "cute").iterdir()) == []  # its temporary folder removed, nothing at the name
    fn, how = cute_cache.load_or_compile(KEY, source, _compile())
    assert how == "compiled" and loads == []


def test_concurrent_writers_leave_one_whole_kernel(cache):
    tmp_path, source, _ = cache
    start = threading.Barrier(4)
    results = []

    def writer(i):
        start.wait()
        results.append(cute_cache.load_or_compile(KEY, source, _compile(b"cubin")))

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4
    folder = _folder(tmp_path, source)
    assert sorted(p.name for p in (tmp_path / "cute").iterdir()) == [folder.name]
    assert cute_cache._check(folder, folder.name) is None


def test_off_when_flashkd_cache_dir_is_empty_and_a_warning_where_it_cannot_be_written(tmp_path, monkeypatch):
    source = tmp_path / "src.py"
    source.write_text("x\n")
    monkeypatch.setenv("FLASHKD_CACHE_DIR", "")
    assert cute_cache.root() is None
    fn, how = cute_cache.load_or_compile(KEY, source, _compile())
    assert how == "compiled" and list(tmp_path.iterdir()) == [source]
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHKD_CACHE_DIR", str(blocker))  # <file>/cute cannot be made
    with pytest.warns(RuntimeWarning, match="FLASHKD_CACHE_DIR picks another folder"):
        fn, how = cute_cache.load_or_compile(KEY, source, _compile())
    assert how == "compiled"
    monkeypatch.delenv("FLASHKD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cute_cache.root() == tmp_path / "xdg" / "flashkd" / "cute"
