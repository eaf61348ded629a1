"""Compiled CuTe DSL kernels kept on disk across processes. Tracing and compiling a variant of the logits GEMM
takes 1.5–2.5 s, and CuTe DSL's own file cache does not spare it (it traces again to find its key); an
exported kernel (`export_to_c`: host launcher and cubin in one object file) loads in milliseconds.

Layout: <root>/<name>/kernel.o and manifest.json, where name hashes everything the object depends on (the
variant, the GPU, nvidia-cutlass-dsl's version, the source of the modules that build it). root is
$FLASHKD_CACHE_DIR/cute, else $XDG_CACHE_HOME (or ~/.cache)/flashkd/cute; FLASHKD_CACHE_DIR set but empty
turns the cache off.

A kernel is written into a private temporary folder and renamed into place whole, so an interrupted or
concurrent writer never leaves a partial folder at a name (the first rename wins; the others' folders are
dropped). On read the manifest must name the folder and hold the object's size and SHA-256: a kernel that
fails the check is never loaded; it is moved aside, compiled again and replaced, with a warning. The check
finds damage, not tampering: a kept kernel is native code that is loaded and run, so the folder is made
readable by its owner alone and should not be one that others can write."""

import hashlib
import json
import os
import platform
import shutil
import uuid
import warnings
from pathlib import Path

FORMAT = 1
OBJECT, MANIFEST = "kernel.o", "manifest.json"


def root() -> Path | None:
    """The cache's folder, or None where FLASHKD_CACHE_DIR is set to ""."""
    env = os.environ.get("FLASHKD_CACHE_DIR")
    if env is not None:
        return Path(env) / "cute" if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashkd" / "cute"


def name_of(key, source: Path | tuple[Path, ...]) -> str:
    """The folder name of a kernel: a hash of `key` (the variant and the GPU), the toolchain and the bytes of
    `source` (the modules whose code the kernel is traced from)."""
    try:
        from importlib.metadata import version

        dsl = version("nvidia-cutlass-dsl")
    except Exception:  # installed without metadata: the source and key still tell variants apart
        dsl = "unknown"
    sources = (source,) if isinstance(source, Path) else source
    parts = [repr(key), dsl, os.environ.get("CUTE_DSL_ARCH", ""), platform.machine(), str(FORMAT),
             *(hashlib.sha256(s.read_bytes()).hexdigest() for s in sources)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check(folder: Path, name: str) -> str | None:
    """Why the kernel in `folder` must not be loaded, or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return f"its manifest is unreadable ({type(e).__name__}: {e})"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("name") != name:
        return f"its manifest does not describe {name} in format {FORMAT}"
    obj = folder / OBJECT
    try:
        size = obj.stat().st_size
    except OSError as e:
        return f"its object file is missing ({e})"
    if size != manifest.get("bytes"):
        return f"its object file has {size} bytes, the manifest says {manifest.get('bytes')}"
    if _sha256(obj) != manifest.get("sha256"):
        return "its object file's SHA-256 differs from the manifest's"
    return None


def _load(obj: Path, prefix: str):
    from cutlass.cute.runtime import load_module

    return load_module(str(obj))[prefix]


def load_or_compile(key, source: Path | tuple[Path, ...], compile_fn):
    """The compiled kernel for `key`: loaded from the cache where a checked copy is there, else
    compile_fn() (a `cute.compile` result), written to the cache for the next process. Returns (fn, how),
    how "cache" or "compiled". Where the cache cannot be written (a read-only home), a warning, and the
    compiled kernel is used all the same."""
    top = root()
    if top is None:
        return compile_fn(), "compiled"
    name = name_of(key, source)
    folder, prefix = top / name, f"flashkd_{name[:16]}"
    if folder.is_dir():
        why = _check(folder, name)
        if why is None:
            try:
                fn = _load(folder / OBJECT, prefix)
            except Exception as e:  # a checked file the runtime refuses (another toolchain build): compile
                why = f"CuTe DSL could not load it ({type(e).__name__}: {e})"
            else:
                return fn, "cache"
        warnings.warn(f"flashkd: the cached CuTe DSL kernel {folder} is not used: {why}; compiling it again",
                      RuntimeWarning, stacklevel=3)
        _discard(folder)
    fn = compile_fn()
    try:
        _store(fn, top, folder, name, prefix, key)
    except OSError as e:
        warnings.warn(f"flashkd: cannot write the compiled CuTe DSL kernel to {top} ({e}); each process will "
                      f"compile it again (FLASHKD_CACHE_DIR picks another folder, or \"\" turns this off)",
                      RuntimeWarning, stacklevel=3)
    return fn, "compiled"


def _store(fn, top: Path, folder: Path, name: str, prefix: str, key) -> None:
    top.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = top / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        fn.export_to_c(str(tmp), "kernel", prefix)
        obj = tmp / OBJECT
        manifest = {"format": FORMAT, "name": name, "key": repr(key), "bytes": obj.stat().st_size,
                    "sha256": _sha256(obj)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        try:
            os.rename(tmp, folder)  # whole or not at all; a folder already there (another writer's) stays
        except OSError:
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _discard(folder: Path) -> None:
    """Moves a folder that failed its check out of the way (a rename, so no reader meets it half removed),
    then removes it."""
    aside = folder.with_name(f".bad-{folder.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(folder, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)
