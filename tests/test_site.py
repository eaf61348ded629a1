"""`flashkd records site`: every link resolves inside the site, every run has its page, the ranks are
`records compare`'s, bad or tampered bundles are listed and never rendered, the HTML nests; and (marked
browser, needs Debian's chromium) each page type loads in headless Chromium without console errors."""

import copy
import csv
import hashlib
import html.parser
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from flashkd.bench import cli
from flashkd.bench.providers import PROVIDERS, Provider
from flashkd.records import check_bundle, digest

DATA = Path(__file__).resolve().parent / "data"
VECTOR_PATH = DATA / "liger-distill-jsd-forward-h100-bt8192.json"
VECTOR = json.loads(VECTOR_PATH.read_text())
FAST_ARGS = ["--h", "12", "--v", "37", "--rep", "1", "--warmup", "0", "--min-reps", "2"]
# Liger-Kernel benchmark rows (distill_jsd_loss forward, H100, liger and torch at four N): the 8192 liger row is
# the test vector's, so one run arrives twice.
CONFIG = ('{"H": 4096, "V": 128256, "mode": "forward", "dtype": "torch.bfloat16", "bias": false, '
          '"weight_hard_loss": 0.5, "weight_soft_loss": 0.5, "ignore_index": -100}')
LIGER_ROWS = [
    ("liger", 1024, 7.735536098480225, 7.729177474975586, 7.798131465911865, "2024-12-03 07:58:46"),
    ("liger", 2048, 15.20411205291748, 15.165056228637695, 15.226079940795898, "2024-12-03 07:58:46"),
    ("liger", 4096, 30.159456253051758, 30.126911163330078, 30.165311813354492, "2024-12-03 07:58:46"),
    ("liger", 8192, 60.24163055419922, 60.24163055419922, 60.24163055419922, "2024-12-03 07:58:46"),
    ("torch", 1024, 10.906111717224121, 10.903244972229004, 10.91296672821045, "2024-12-03 07:59:18"),
    ("torch", 2048, 21.480207443237305, 21.465139389038086, 21.489286422729492, "2024-12-03 07:59:18"),
    ("torch", 4096, 42.96339416503906, 42.96237564086914, 42.96440887451172, "2024-12-03 07:59:18"),
    ("torch", 8192, 85.3946533203125, 85.3946533203125, 85.3946533203125, "2024-12-03 07:59:18"),
]
TAMPERED_MEDIAN = 12345678  # ns: "12.3457 ms" must not appear as a measurement anywhere


def _liger_csv() -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["kernel_name", "kernel_provider", "kernel_operation_mode", "metric_name", "metric_unit", "x_name",
                "x_label", "x_value", "y_value_50", "y_value_20", "y_value_80", "extra_benchmark_config_str",
                "gpu_name", "timestamp", "liger_version"])
    for provider, n, p50, p20, p80, stamp in LIGER_ROWS:
        w.writerow(["distill_jsd_loss", provider, "forward", "speed", "ms", "BT", "B x T", n, p50, p20, p80, CONFIG,
                    "NVIDIA H100 80GB HBM3", stamp, "0.4.2"])
    return out.getvalue()


def _bad_bundles(folder: Path) -> dict[str, str]:
    """Bad files -> a phrase of the problem each must be listed with."""
    folder.mkdir()
    tampered = copy.deepcopy(VECTOR)
    tampered["run"].pop("canonical")
    tampered["run"]["manifest"]["spec"]["timing"]["latencyNs"]["median"] = TAMPERED_MEDIAN  # digest left as stated
    (folder / "tampered.json").write_text(json.dumps(tampered))
    schema = copy.deepcopy(VECTOR)
    schema["run"]["manifest"]["spec"]["status"] = "<b>passes</b>"
    (folder / "schema.json").write_text(json.dumps(schema))
    (folder / "truncated.json").write_text(json.dumps(VECTOR)[:200])
    # Sound digests, but the run points at another workload: consistent hashing does not make it valid.
    moved = copy.deepcopy(VECTOR)
    moved["run"].pop("canonical")
    moved["run"]["manifest"]["spec"]["workloadDigest"] = "sha256:" + "0" * 64
    moved["run"]["digest"] = digest(moved["run"]["manifest"])
    (folder / "moved.json").write_text(json.dumps(moved))
    return {"tampered.json": "run (BenchmarkRun) digest: stated", "schema.json": "spec/status",
            "truncated.json": "cannot read", "moved.json": "run.spec.workloadDigest"}


def _cli(argv, capsys):
    capsys.readouterr()
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny CPU `flashkd bench` run (with a provider that fails the gate), imported Liger rows, the
    KernelIndex test vector, bad files; and the site of them all."""
    root = tmp_path_factory.mktemp("site")
    capsys = _Capture()

    def wrong(w, x):
        fn = PROVIDERS["flashkd"].make(w, x)
        return lambda: fn() * 1.5

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PROVIDERS, "wrong", Provider(wrong, lambda: "0"))
        with capsys:
            bench_code = cli.main(["bench", "--device", "cpu", "-n", "5", "9", "--loss", "jsd", "--form", "heads",
                                   "--weight-hard", "0.5", "--weight-soft", "0.5", "--modes", "full", "--providers",
                                   "flashkd", "torch", "wrong", *FAST_ARGS, "--out", str(root / "bench")])
    bench_out = capsys.text
    (root / "rows.csv").write_text(_liger_csv())
    with capsys:
        assert cli.main(["records", "import-liger", str(root / "rows.csv"), "--out", str(root / "liger")]) == 0
    shutil.copy(VECTOR_PATH, root / "vector.json")
    bad = _bad_bundles(root / "bad")
    good = [root / "bench" / "records", root / "liger", root / "vector.json"]
    flashkd_9 = next(p for p in (root / "bench" / "records").glob("*flashkd-n9*.json"))
    with capsys:
        code = cli.main(["records", "site", *map(str, good), str(root / "bad"), "--out", str(root / "site"),
                         "--compare", str(flashkd_9), str(root / "vector.json")])
    return dict(root=root, site=root / "site", good=good, bad=bad, code=code, out=capsys.text, err=capsys.err,
                bench_code=bench_code, bench_out=bench_out, cross=(flashkd_9, root / "vector.json"))


class _Capture:
    """stdout/stderr of a block (capsys is function-scoped; the fixture is per module)."""

    def __enter__(self):
        import contextlib

        self._out, self._err = io.StringIO(), io.StringIO()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(self._out))
        self._stack.enter_context(contextlib.redirect_stderr(self._err))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        self.text, self.err = self._out.getvalue(), self._err.getvalue()


def _good_bundles(built) -> list[tuple[Path, dict]]:
    files = [p for g in built["good"] for p in (sorted(g.rglob("*.json")) if g.is_dir() else [g])]
    return [(p, json.loads(p.read_text())) for p in files]


def _pages(site: Path) -> list[Path]:
    return sorted(site.rglob("*.html"))


class _Page(html.parser.HTMLParser):
    """Links, ids, text and nesting errors of one page."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr",
            "path", "rect", "circle"}  # the SVG shapes are written self-closed
    OPTIONAL_END = {"p", "li", "td", "th", "tr", "thead", "tbody", "option", "summary"}

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.links, self.ids, self.errors, self.stack, self.chunks, self.rows = [], set(), [], [], [], []
        self._row = None
        self.feed(text)
        self.close()
        if self.stack:
            self.errors.append(f"unclosed at end: {self.stack}")

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("href", "src"):
            if name in attrs:
                self.links.append(attrs[name])
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "tr":
            self._row = []
            self.rows.append(self._row)
        if tag in ("td", "th") and self._row is not None:
            self._row.append({"text": "", "href": None})
        if tag == "a" and self._row:
            self._row[-1]["href"] = self._row[-1]["href"] or attrs.get("href")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in self.VOID:
            self.stack.pop()

    def handle_endtag(self, tag):
        if tag in self.VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'} at line {self.getpos()[0]}")
            if tag in self.stack:
                del self.stack[len(self.stack) - 1 - self.stack[::-1].index(tag):]
            return
        self.stack.pop()
        if tag == "tr":
            self._row = None

    def handle_data(self, data):
        self.chunks.append(data)
        if self._row:
            self._row[-1]["text"] += data

    @property
    def text(self):
        return re.sub(r"\s+", " ", "".join(self.chunks))


def _parse(path: Path) -> _Page:
    return _Page(path.read_text("utf-8"))


# -- the tests --------------------------------------------------------------------------------------

def test_bench_writes_its_site(built):
    out = built["root"] / "bench"
    assert built["bench_code"] == 1  # the wrong provider failed the gate
    assert f"{out / 'site' / 'index.html'}" in built["bench_out"]
    runs = {json.loads(p.read_text())["run"]["digest"] for p in (out / "records").glob("*.json")}
    pages = {p.stem for p in (out / "site" / "runs").glob("*.html")}
    assert len(runs) == 2 * 3 and pages == {d.removeprefix("sha256:")[:16] for d in runs}


def test_every_link_resolves(built):
    site = built["site"]
    pages = _pages(site)
    parsed = {p: _parse(p) for p in pages}
    checked = 0
    for page, doc in parsed.items():
        for link in doc.links:
            url = urlparse(link)
            assert not url.scheme and not url.netloc, f"{page.relative_to(site)}: {link} leaves the site"
            target = (page.parent / unquote(url.path)).resolve() if url.path else page
            assert target.is_file(), f"{page.relative_to(site)}: {link} -> missing {target}"
            assert site.resolve() in target.parents, f"{page.relative_to(site)}: {link} is outside the site"
            if url.fragment:
                assert url.fragment in parsed[target].ids, f"{page.relative_to(site)}: {link}: no such id"
            checked += 1
    assert checked > 10 * len(pages)


def test_html_is_well_formed(built):
    for page in _pages(built["site"]):
        doc = _parse(page)
        assert doc.errors == [], f"{page}: {doc.errors[:3]}"
        text = page.read_text("utf-8")
        assert text.startswith("<!doctype html>") and '<meta charset="utf-8">' in text


def test_every_input_run_has_its_page(built):
    site = built["site"]
    bundles = _good_bundles(built)
    runs = {b["run"]["digest"] for _, b in bundles}
    assert len(bundles) == len(runs) + 1  # the vector and its imported row are one run
    assert {p.stem for p in (site / "runs").glob("*.html")} == {d.removeprefix("sha256:")[:16] for d in runs}
    for d in runs:
        stem = d.removeprefix("sha256:")[:16]
        page = (site / "runs" / f"{stem}.html").read_text("utf-8")
        assert d in page
        # Its bundle as submitted, and the canonical manifest whose SHA-256 is the digest.
        copied = json.loads((site / "bundles" / f"{stem}.json").read_text())
        assert copied["run"]["digest"] == d and check_bundle(copied) == []
        canonical = (site / "runs" / f"{stem}.canonical.json").read_bytes()
        assert "sha256:" + hashlib.sha256(canonical).hexdigest() == d
    assert built["out"].startswith(f"{len(runs)} run(s) in ")


def _compare_ranks(built, capsys) -> dict[str, list[tuple[int | None, str]]]:
    """`records compare`'s ranking of the good files: comparison key -> [(rank or None, run digest)]."""
    code, out, _ = _cli(["records", "compare", *map(str, built["good"])], capsys)
    assert code == 0
    by_name = {p.name: b["run"]["digest"] for p, b in _good_bundles(built)}
    groups, key = {}, None
    for line in out.splitlines():
        if line.startswith("  comparison key "):
            key = line.split()[-1]
            groups[key] = []
        elif key and re.match(r"^\s+(\d+|-)\s", line):
            rank = line.split()[0]
            groups[key].append((None if rank == "-" else int(rank), by_name[line.split()[-1]]))
    return groups


def test_ranks_agree_with_records_compare(built, capsys):
    expected = _compare_ranks(built, capsys)
    site = built["site"]
    # bench: N=5, 9, the wrong provider's untimed runs apart (their primary metric is an error); liger: 4 N
    assert len(expected) == len(list((site / "groups").glob("*.html"))) == 2 * 2 + 4
    for key, ranks in expected.items():
        doc = _parse(site / "groups" / f"{key.removeprefix('sha256:')[:16]}.html")
        assert key in doc.text
        rows = [r for r in doc.rows if r and r[0]["text"].strip() not in ("Rank", "")
                and (r[1]["href"] or "").startswith("../runs/")]
        shown = [(None if r[0]["text"].strip() == "—" else int(r[0]["text"]),
                  Path(r[1]["href"]).stem) for r in rows]
        assert shown == [(rank, d.removeprefix("sha256:")[:16]) for rank, d in ranks]
        best = next((d for rank, d in ranks if rank == 1), None)
        for rank, d in ranks:
            stem = d.removeprefix("sha256:")[:16]
            page = _parse(site / "runs" / f"{stem}.html")
            if rank is None:
                assert "Not ranked in its comparison group" in page.text
            elif rank == 1:
                assert "Rank 1 in its comparison group" in page.text and "Compare with #1" not in page.text
            else:
                assert f"Rank {rank} in its comparison group · Compare with #1" in page.text
                link = f"../compare/{best.removeprefix('sha256:')[:16]}-vs-{stem}.html"
                assert link in page.links
    assert any(rank is None for ranks in expected.values() for rank, _ in ranks)  # the wrong provider's runs


def test_liger_rows_ranked_like_any_run(built):
    site = built["site"]
    doc = _parse(site / "runs" / f"{VECTOR['run']['digest'].removeprefix('sha256:')[:16]}.html")
    for text in ("60.2416 ms", "p20 60.2416 ms · p80 60.2416 ms", "Rank 1 in its comparison group",
                 VECTOR["run"]["manifest"]["spec"]["sourceNative"]["externalId"], "liger-kernel-bench",
                 VECTOR["workload"]["digest"], "How to cite"):
        assert text in doc.text, text
    torch_8192 = next(b for _, b in _good_bundles(built) if b["run"]["manifest"]["spec"].get("sourceNative", {})
                      .get("externalId", "").startswith("distill_jsd_loss/forward/torch/nvidia-h100-80gb-hbm3/"
                                                        "hidden4096-tokens8192"))
    doc = _parse(site / "runs" / f"{torch_8192['run']['digest'].removeprefix('sha256:')[:16]}.html")
    assert "Rank 2 in its comparison group · Compare with #1" in doc.text and "×1.42" in doc.text


def test_compare_pages(built):
    site = built["site"]
    bundles = dict((b["run"]["digest"], b) for _, b in _good_bundles(built))
    names = {p.name for p in (site / "compare").glob("*.html")}
    assert len(names) == 2 + 4 + 1  # every pair within a group (flashkd and torch, liger and torch), one asked for
    a, b = (json.loads(p.read_text())["run"]["digest"] for p in built["cross"])
    cross = _parse(site / "compare" / f"{a.removeprefix('sha256:')[:16]}-vs-{b.removeprefix('sha256:')[:16]}.html")
    assert "Different comparison groups" in cross.text and "not a ranking" in cross.text
    index = _parse(site / "index.html")
    assert f"compare/{a.removeprefix('sha256:')[:16]}-vs-{b.removeprefix('sha256:')[:16]}.html" in index.links
    assert len(bundles) == len(list((site / "runs").glob("*.html")))


def test_sweep_and_charts(built):
    site = built["site"]
    sweeps = sorted((site / "sweeps").glob("*.html"))
    assert len(sweeps) == 2  # bench N=5, 9; liger N=1024..8192
    for page in sweeps:
        text = page.read_text("utf-8")
        assert text.count("<svg") == 1 and "against tokens" in text
    group = next(p for p in (site / "groups").glob("*.html") if "60.2416 ms" in p.read_text("utf-8"))
    assert "<svg" in group.read_text("utf-8")


def test_artifacts_copied_when_their_digest_matches(built):
    site = built["site"]
    log = (built["root"] / "bench" / "results.csv").read_bytes()
    found = list((site / "artifacts").rglob("results.csv"))
    assert len(found) == 1 and found[0].read_bytes() == log
    assert found[0].parent.name == hashlib.sha256(log).hexdigest()


def test_bad_bundles_are_listed_not_rendered(built):
    site = built["site"]
    assert built["code"] == 1
    index = _parse(site / "index.html")
    for name, phrase in built["bad"].items():
        assert f"{built['root'] / 'bad' / name}: " in built["err"] and phrase in built["err"]
        assert str(built["root"] / "bad" / name) in index.text and phrase in index.text
    assert "<b>passes</b>" not in (site / "index.html").read_text("utf-8")  # escaped, not markup
    # The tampered copy states the vector's digest; the vector's page shows the vector's numbers only.
    tampered = f"{TAMPERED_MEDIAN / 1e6:.4f} ms"
    for page in _pages(site):
        assert tampered not in page.read_text("utf-8"), page
    for copied in (site / "bundles").glob("*.json"):
        assert check_bundle(json.loads(copied.read_text())) == []
    moved = json.loads((built["root"] / "bad" / "moved.json").read_text())["run"]["digest"]
    assert not (site / "runs" / f"{moved.removeprefix('sha256:')[:16]}.html").exists()


def test_only_bad_bundles(tmp_path, capsys):
    _bad_bundles(tmp_path / "bad")
    code, out, err = _cli(["records", "site", str(tmp_path / "bad"), "--out", str(tmp_path / "site")], capsys)
    assert code == 1 and out.startswith("0 run(s) in 0 comparison group(s)")
    assert "4 file(s) rejected" in err
    assert list((tmp_path / "site" / "runs").iterdir()) == []
    assert "Rejected files (4)" in _parse(tmp_path / "site" / "index.html").text


def test_out_folder_and_arguments(tmp_path, capsys):
    (tmp_path / "b").mkdir()
    shutil.copy(VECTOR_PATH, tmp_path / "b" / "v.json")
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    code, _, err = _cli(["records", "site", str(tmp_path / "b"), "--out", str(other)], capsys)
    assert code == 2 and "is not a site written by flashkd records site" in err and (other / "keep.txt").exists()
    site = tmp_path / "site"
    assert _cli(["records", "site", str(tmp_path / "b"), "--out", str(site)], capsys)[0] == 0
    (site / "runs" / "stale.html").write_text("old")
    # an earlier site is not replaced without a word: refused, unless --replace asks for it
    code, _, err = _cli(["records", "site", str(tmp_path / "b"), "--out", str(site)], capsys)
    assert code == 2 and err.strip() == (f"flashkd records site: --out {site}: holds a site written before; pass "
                                         "--replace to replace it, or name a new folder")
    assert (site / "runs" / "stale.html").exists()
    assert _cli(["records", "site", str(tmp_path / "b"), "--out", str(site), "--replace"], capsys)[0] == 0  # rebuilt
    assert not (site / "runs" / "stale.html").exists()
    (tmp_path / "empty").mkdir()
    code, _, err = _cli(["records", "site", str(tmp_path / "empty"), "--out", str(site), "--replace"], capsys)
    assert code == 2 and "no bundle files found" in err
    code, _, err = _cli(["records", "site", str(tmp_path / "missing.json"), "--out", str(site), "--replace"], capsys)
    # a PATH that does not exist: a usage error, as in records verify and compare, and nothing written
    assert code == 2 and err.strip() == f"flashkd records site: {tmp_path / 'missing.json'}: no such file or folder"
    code, _, err = _cli(["records", "site", str(tmp_path / "b"), "--out", str(site), "--replace", "--compare", "abcdef12",
                         str(tmp_path / "b" / "v.json")], capsys)
    assert code == 2 and "--compare abcdef12: expected one sound run" in err


@pytest.mark.parametrize("unit,values", [("tokens", (1e308, 1.7976931348623157e308)), ("ns", (5e-324, 1e-300))])
def test_a_sweep_of_measurements_at_the_doubles_ends_is_drawn(built, tmp_path, capsys, unit, values):
    """Measurements near the double's maximum (which verify accepts) overflowed the sweep chart's axis
    range (OverflowError, no site); near its minimum, shown in ms, they underflowed to 0."""
    folder = tmp_path / "recs"
    folder.mkdir()
    for p in sorted((built["root"] / "bench" / "records").glob("*.json")):
        b = json.loads(p.read_text())
        spec = b["run"]["manifest"]["spec"]
        spec.pop("timing", None)
        value = values[1] if "-n9-" in p.name else values[0]
        spec["measurements"] = [{"metric": "throughput", "statistic": "median", "unit": unit, "value": value}]
        b["run"].pop("canonical", None)
        b["run"]["digest"] = digest(b["run"]["manifest"])
        assert check_bundle(b) == []  # a sound bundle
        (folder / p.name).write_text(json.dumps(b))
    code, out, err = _cli(["records", "site", str(folder), "--out", str(tmp_path / "site")], capsys)
    assert code == 0 and "Traceback" not in err, err
    sweeps = list((tmp_path / "site" / "sweeps").glob("*.html"))
    assert sweeps
    for page in sweeps:
        parsed = _parse(page)
        assert not parsed.errors
        svg = page.read_text()
        assert "nan" not in svg.lower().replace("nanos", "") and "inf" not in re.sub(r"[a-z]inf|inf[a-z]", "", svg)
        assert "<circle" in svg


def test_two_builds_into_one_out_at_once(tmp_path, capsys, monkeypatch):
    """Two builds into one --out: one of them died with a FileNotFoundError traceback (each removed the
    site the other had just put there). Now the second says so in one line, exits 2 and writes nothing;
    the first's site is whole."""
    import threading

    from flashkd.records import site as site_module

    (tmp_path / "b").mkdir()
    shutil.copy(VECTOR_PATH, tmp_path / "b" / "v.json")
    out = tmp_path / "site"
    assert _cli(["records", "site", str(tmp_path / "b"), "--out", str(out)], capsys)[0] == 0  # an earlier site
    inside, release = threading.Event(), threading.Event()
    real = site_module._write

    def slow(site, building):
        inside.set()
        assert release.wait(60)
        return real(site, building)

    monkeypatch.setattr(site_module, "_write", slow)
    first = {}
    thread = threading.Thread(target=lambda: first.update(code=site_module.main(
        type("Args", (), dict(paths=[tmp_path / "b"], out=out, compare=[], replace=True))())))
    thread.start()
    try:
        assert inside.wait(60)
        monkeypatch.setattr(site_module, "_write", real)
        code, out_text, err = _cli(["records", "site", str(tmp_path / "b"), "--out", str(out), "--replace"], capsys)
    finally:
        release.set()
        thread.join(60)
    assert code == 2 and "Traceback" not in err
    assert err.count("\n") == 1 and "another `flashkd records site` is building it now" in err, err
    assert first["code"] == 0 and (out / "index.html").exists() and (out / ".flashkd-site").exists()
    assert not list(tmp_path.glob(".site.*.partial")) and not (tmp_path / ".site.lock").exists()
    # separate processes, started together: each says what it did, none dies with a traceback
    cmd = [sys.executable, "-m", "flashkd", "records", "site", str(tmp_path / "b"), "--out", str(out), "--replace"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode in (0, 2) and "Traceback" not in err, err
        assert p.returncode == 0 or "another `flashkd records site` is building it now" in err, err
    assert (out / "index.html").exists()


def test_a_rebuild_never_shows_a_half_removed_site(tmp_path, monkeypatch):
    """A second build's first check (before it asks for the lock) ran while the first removed the old
    site file by file: it saw a folder without the marker and called it foreign. The old site now leaves
    by rename, so at every step of the rebuild --out holds a whole site or nothing."""
    from flashkd.records import site as site_module

    (tmp_path / "b").mkdir()
    shutil.copy(VECTOR_PATH, tmp_path / "b" / "v.json")
    out = tmp_path / "site"
    site_module.build([tmp_path / "b"], out)
    seen = []
    real_rmtree, real_rename = shutil.rmtree, os.rename

    def look():
        try:
            site_module.check_out(out, replace=True)
            seen.append("ok")
        except ValueError as e:
            seen.append(str(e))

    def slow_rmtree(path, ignore_errors=False):  # the marker first, then one file at a time
        path = Path(path)
        if not path.exists():
            return
        marker = path / site_module.MARKER
        if marker.exists():
            marker.unlink()
            look()
        for root, dirs, names in os.walk(path, topdown=False):
            for name in names:
                os.unlink(os.path.join(root, name))
                look()
            os.rmdir(root)
            look()

    def rename(a, b):
        real_rename(a, b)
        look()

    monkeypatch.setattr(site_module.shutil, "rmtree", slow_rmtree)
    monkeypatch.setattr(site_module.os, "rename", rename)
    site_module.build([tmp_path / "b"], out, replace=True)
    monkeypatch.setattr(site_module.os, "rename", real_rename)
    assert len(seen) > 10 and set(seen) == {"ok"}, [s for s in seen if s != "ok"][:1]
    assert (out / "index.html").exists() and (out / site_module.MARKER).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "site"]
    # the new site failing to move in: the old one back in place, nothing left beside it
    before = (out / "index.html").read_bytes()
    monkeypatch.setattr(site_module.shutil, "rmtree", real_rmtree)

    def refuse(a, b):
        if Path(a).name.endswith(site_module.PARTIAL):
            raise OSError(28, "No space left on device")
        real_rename(a, b)

    monkeypatch.setattr(site_module.os, "rename", refuse)
    with pytest.raises(OSError, match="No space left"):
        site_module.build([tmp_path / "b"], out, replace=True)
    monkeypatch.setattr(site_module.os, "rename", real_rename)
    assert (out / "index.html").read_bytes() == before and (out / site_module.MARKER).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "site"]


def test_what_sits_at_the_lock_path_is_one_line_and_a_users_file_there_is_kept(tmp_path, capsys):
    """A directory at --out's lock path (.NAME.lock) died with an IsADirectoryError traceback; a regular
    file or a FIFO the user had there was deleted after the build."""
    (tmp_path / "b").mkdir()
    shutil.copy(VECTOR_PATH, tmp_path / "b" / "v.json")
    out, lock = tmp_path / "site8", tmp_path / ".site8.lock"
    argv = ["records", "site", str(tmp_path / "b"), "--out", str(out), "--replace"]
    for make, got in ((lock.mkdir, "a directory"), (lambda: os.mkfifo(lock), "a FIFO")):
        make()
        code, _, err = _cli(argv, capsys)
        assert code == 2 and err == (f"flashkd records site: --out {out}: expected no file or a lock file at {lock} "
                                     f"(flashkd locks it while it writes), got {got}; move it away\n"), err
        assert not out.exists()
        lock.rmdir() if lock.is_dir() else lock.unlink()
    lock.write_text("the user's\n")
    assert _cli(argv, capsys)[0] == 0 and (out / "index.html").exists()
    assert lock.read_text() == "the user's\n"


def test_a_site_inside_its_input_folder_is_not_read_as_input(built, tmp_path, capsys):
    """A rebuild into a folder under its own input read the site's copies of the bundles (each run
    "shown once") and its canonical manifests (rejected: exit 1)."""
    recs = tmp_path / "recs"
    shutil.copytree(built["root"] / "bench" / "records", recs)
    first = _cli(["records", "site", str(recs), "--out", str(recs / "site")], capsys)
    # a killed earlier build left its hidden folder beside the site
    shutil.copytree(recs / "site", recs / f".site.12345{'.partial'}")
    # and a rebuild killed between its two renames, the site it was replacing set aside
    shutil.copytree(recs / "site", recs / ".site.old")
    again = _cli(["records", "site", str(recs), "--out", str(recs / "site"), "--replace"], capsys)
    assert first[0] == again[0] == 0 and again[2] == "" and again[1] == first[1], again
    assert (recs / ".site.12345.partial").exists()  # another build's: left as it was
    assert not (recs / ".site.old").exists()  # this build's own aside name: cleared before its swap


def _restamp(bundle: dict) -> dict:
    """The bundle with its implementation and run digests recomputed (after an edit of their specs)."""
    for name in ("implementation", "run"):
        if name == "run":
            bundle["run"]["manifest"]["spec"]["implementationDigest"] = bundle["implementation"]["digest"]
        bundle[name].pop("canonical", None)
        bundle[name]["digest"] = digest(bundle[name]["manifest"])
    return bundle


def test_index_opens_with_the_runs_measured_here(built):
    """The index opened with the imported Liger rows (their operation's title sorts first), the user's own
    runs further down."""
    text = _parse(built["site"] / "index.html").text
    assert text.index("Runs measured here, by operation") < text.index("Imported records, by operation")
    assert text.index("flashkd bench · full") < text.index("Liger benchmark harness")
    every = _parse(built["site"] / "index.html").rows
    first = next(r for r in every if len(r) == 6 and r[-1]["text"] == "json")  # the "Every run" table
    assert first[0]["text"].startswith("distill_jsd_loss · ")  # a bench run's title, not a Liger row's


CAVEAT = "CPU wall-clock checks, not a speed comparison."
# What ranks or compares runs on a page: a rank, a #1, a ratio
RANKING = re.compile(r"Rank \d|#\d|×\d|Ratio to #1|B / A")


def _cpu_run_ids(built) -> set[str]:
    return {b["run"]["digest"].removeprefix("sha256:")[:16] for p, b in _good_bundles(built) if "bench" in p.parts}


def _caveat_first(text: str, page) -> None:
    """The caveat stands where the ranking does: on the page, before its first rank, #1 or ratio."""
    main = text.split("rejected", 1)[-1]  # past the header's counts
    assert CAVEAT in main, page
    ranking = RANKING.search(main)
    assert ranking is None or main.index(CAVEAT) < ranking.start(), (page, main[:ranking.start() + 40])


def test_every_page_that_ranks_cpu_runs_says_they_are_no_speed_comparison(built):
    """The console said CPU times are "not a speed comparison", while the site ranked the same runs "by
    latency", with "Ratio to #1" and "Rank 1 in its comparison group", and no word of it."""
    site, cpu = built["site"], _cpu_run_ids(built)
    ranked_pages = 0
    for run_id in cpu:
        page = site / "runs" / f"{run_id}.html"
        text = _parse(page).text
        if re.search(r"Rank \d+ in its comparison group", text):
            _caveat_first(text, page)
            ranked_pages += 1
        group = re.search(r'href="\.\./groups/([0-9a-f]+)\.html"', page.read_text()).group(1)
        _caveat_first(_parse(site / "groups" / f"{group}.html").text, group)
    assert ranked_pages >= 2
    compares = [p for p in (site / "compare").glob("*.html") if any(i in p.name for i in cpu)]
    sweeps = [p for p in (site / "sweeps").glob("*.html") if any(f"runs/{i}.html" in p.read_text() for i in cpu)]
    assert compares and sweeps  # within a group, and flashkd's N=9 against the published vector (--compare)
    for page in compares + sweeps:
        _caveat_first(_parse(page).text, page)
    index = _parse(site / "index.html").text
    own = index[index.index("Runs measured here"):index.index("Imported records")]
    assert own.index(CAVEAT) < own.index("#1 primary")
    every = index[index.index("Every run"):]
    assert every.index(CAVEAT) < every.index("Rank")
    sweeps_listed = index[index.index("Sweeps"):index.index("By GPU")]
    assert CAVEAT in sweeps_listed
    # runs measured on a GPU (Liger's published rows, the KernelIndex vector) carry none
    gpu_runs = [p for p in (site / "runs").glob("*.html") if p.stem not in cpu]
    assert gpu_runs and not any(CAVEAT in p.read_text() for p in gpu_runs)
    imported = index[index.index("Imported records"):index.index("Sweeps")]
    assert "H100" in imported and CAVEAT not in imported


def test_run_pages_read_as_a_persons_page_first(built):
    """What ran, on what, how fast, how exact; then the digests and canonical JSON. The page opened with
    its rank and went on to six digests before it said how exact the run was."""
    site, cpu = built["site"], _cpu_run_ids(built)
    for page in sorted((site / "runs").glob("*.html")):
        text = _parse(page).text
        order = [text.index(w) for w in ("What ran", "How fast", "How exact", "Correctness", "Identity and digests",
                                          "Canonical manifest", "How to cite")]
        assert order == sorted(order), page
        assert text.index("How exact") < text.index("sha256:"), page
    timed = next(p for p in (site / "runs").glob("*.html")
                 if p.stem in cpu and "passed" in _parse(p).text and "Rank 1 " in _parse(p).text)
    text = _parse(timed).text
    assert re.search(r"On ?[^·]+\(CPU, [a-z0-9_]+\) · pytorch \d", text)  # (the text joins a row's cells)
    assert re.search(r"How fast ?[\d.]+ ms median \(p20 [\d.]+ ms, p80 [\d.]+ ms\); rank 1 of \d+ in its comparison "
                     r"group: wall clock on a CPU, not a speed comparison", text)
    assert re.search(r"How exact ?passed · largest relative error [\d.e+-]+ against the reference \(the gate allows "
                     r"0\.0001\)", text)
    vector = _parse(site / "runs" / f"{VECTOR['run']['digest'].removeprefix('sha256:')[:16]}.html").text
    assert "(GPU, sm_90)" in vector and "not checked by its source" in vector


def _group_titles(site: Path) -> list[str]:
    return [re.search(r"<h1>(.*?)</h1>", p.read_text("utf-8")).group(1) for p in (site / "groups").glob("*.html")]


def test_group_titles_name_the_timed_pass(built, tmp_path, capsys):
    """Groups of one workload differ in their protocol (forward, full, ...): the title says it (four
    groups of a run's four modes had one title)."""
    for h1 in _group_titles(built["site"]):
        assert h1.endswith((" · flashkd bench · full · cpu", " · Liger benchmark harness · forward pass")), h1
    out = tmp_path / "modes"
    assert cli.main(["bench", "--device", "cpu", "-n", "5", "--loss", "jsd", "--form", "heads", "--weight-hard", "0.5",
                     "--weight-soft", "0.5", "--providers", "flashkd", *FAST_ARGS, "--out", str(out)]) == 0
    titles = _group_titles(out / "site")
    assert len(titles) == 4 and len(set(titles)) == 4, titles  # full, forward, backward, no-grad-forward


def test_hidden_sizes_are_named_alike_in_every_form(built, tmp_path, capsys):
    """The heads form's workloads said `hidden=` (the teacher's) where a top-k teacher's said
    `student_hidden=`: shown as student_hidden and teacher_hidden alike; the records keep their axes."""
    index = _parse(built["site"] / "index.html").text
    assert "tokens=5, student_hidden=6, teacher_hidden=12, vocab=37" in index  # the bench's heads form
    assert "tokens=1024, student_hidden=2048, teacher_hidden=4096, vocab=128256" in index  # Liger's rows
    # every page, tooltips and the citation included: the run and compare pages named the workload by its title
    for page in _pages(built["site"]):
        assert not re.search(r"(?<![a-z_])hidden=", page.read_text()), page
    for page in (built["site"] / "runs").glob("*.html"):  # the breadcrumb, What ran, the Workload row, How to cite
        assert page.read_text().count("student_hidden=") == 4, page
    bench = [b for p, b in _good_bundles(built) if "bench" in p.parts]
    assert {tuple(b["workload"]["manifest"]["spec"]["axes"]) for b in bench} == {("tokens", "hidden", "vocab")}
    out = tmp_path / "topk"
    assert cli.main(["bench", "--device", "cpu", "-n", "5", "--form", "topk", "--loss", "forward_kl", "--k", "3",
                     "--modes", "full", "--providers", "flashkd", *FAST_ARGS, "--out", str(out)]) == 0
    text = _parse(out / "site" / "index.html").text
    assert "tokens=5, student_hidden=6, vocab=37, k=3" in text and not re.search(r"(?<![a-z_])hidden=", text)


def test_metadata_is_escaped(tmp_path, capsys):
    hostile = '<script>alert("x")</script> & co'
    first = copy.deepcopy(VECTOR)
    first["implementation"]["manifest"]["metadata"]["title"] = f"op · {hostile}"
    first["run"]["manifest"]["metadata"]["title"] = "<img src=x onerror=alert(1)>"
    second = copy.deepcopy(first)
    second["implementation"]["manifest"]["spec"]["callable"]["language"] = "python"
    second["run"]["manifest"]["spec"]["timing"]["latencyNs"]["median"] = 70000000
    second["implementation"]["manifest"]["metadata"]["title"] = "op · </text><script>alert(2)</script>"
    _restamp(second)
    assert check_bundle(first) == [] and check_bundle(second) == []  # metadata is not identity
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(second))
    assert _cli(["records", "site", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out",
                 str(tmp_path / "site")], capsys)[0] == 0
    for page in _pages(tmp_path / "site"):
        text = page.read_text("utf-8")
        assert "<script" not in text and "<img" not in text, page
        assert _parse(page).errors == [], page
    group = next((tmp_path / "site" / "groups").glob("*.html")).read_text("utf-8")
    assert "<svg" in group and "&lt;/text&gt;&lt;script&gt;alert(2)" in group  # the chart's label, escaped
    run = (tmp_path / "site" / "runs" / f"{first['run']['digest'].removeprefix('sha256:')[:16]}.html").read_text()
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; &amp; co" in run


# -- a real browser ---------------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    """Headless Chromium over the DevTools protocol on a pipe (--remote-debugging-pipe: JSON messages
    separated by NUL on fds 3 and 4), so no client library and no port."""

    def __init__(self, profile: Path):
        to_r, self._to = os.pipe()
        self._from, from_w = os.pipe()

        def fds():
            os.dup2(to_r, 3)
            os.dup2(from_w, 4)

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             f"--user-data-dir={profile}", "--no-first-run", "--hide-scrollbars", "about:blank"],
            preexec_fn=fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self._buf, self._id, self.events = b"", 0, []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=True)

    def _read(self, timeout=30.0) -> dict:
        import select

        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            ready, _, _ = select.select([self._from], [], [], max(deadline - time.monotonic(), 0))
            chunk = os.read(self._from, 1 << 20) if ready else b""
            if not chunk:
                raise TimeoutError("chromium did not answer")
            self._buf += chunk
        message, self._buf = self._buf.split(b"\0", 1)
        return json.loads(message)

    def call(self, method, session=False, **params):
        self._id += 1
        message = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait(self, method, timeout=30.0):
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._read(max(deadline - time.monotonic(), 0.1)))

    def load(self, url: str) -> list[str]:
        """Navigates, waits for the load event, returns its console errors, exceptions and failed loads."""
        self.events = []
        self.call("Page.navigate", session=True, url=url)
        self.wait("Page.loadEventFired")
        self.call("Runtime.evaluate", session=True, expression="1")  # drain what the load logged
        errors = []
        for e in self.events:
            p = e.get("params", {})
            if e.get("method") == "Runtime.exceptionThrown":
                details = p["exceptionDetails"]
                errors.append(f"exception: {details.get('exception', {}).get('description') or details['text']}")
            elif e.get("method") == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                errors.append(f"console.{p['type']}: {[a.get('value') for a in p['args']]}")
            elif e.get("method") == "Log.entryAdded" and p["entry"]["level"] == "error":
                errors.append(f"{p['entry']['source']}: {p['entry']['text']} {p['entry'].get('url', '')}")
        return errors

    def screenshot(self, path: Path, width=1280):
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=800, deviceScaleFactor=1,
                  mobile=False)  # the page's own height, not the last page's
        height = self.call("Runtime.evaluate", session=True, returnByValue=True,
                           expression="document.documentElement.scrollHeight")["result"]["value"]
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=min(int(height), 6000),
                  deviceScaleFactor=1, mobile=False)
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        import base64

        path.write_bytes(base64.b64decode(data))

    def close(self):
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.close(self._to)
        os.close(self._from)


@pytest.fixture
def browser(tmp_path):
    if CHROMIUM is None:
        pytest.fail("chromium not found: apt-get install chromium (the browser tests need it)")
    b = Chromium(tmp_path / "profile")
    yield b
    b.close()


@pytest.mark.browser
def test_browser_catches_errors(browser, tmp_path):
    """The check below can fail: a page with a missing stylesheet and image, console.error and an exception."""
    page = tmp_path / "broken.html"
    page.write_text('<!doctype html><html><head><title>x</title><link rel="stylesheet" href="missing.css"></head>'
                    '<body><img src="missing.png"><script>console.error("boom"); missing_function();</script>'
                    '</body></html>')
    errors = browser.load(page.as_uri())
    assert any("missing.css" in e for e in errors), errors
    assert any("missing.png" in e for e in errors), errors
    assert any("boom" in e for e in errors) and any("missing_function" in e for e in errors), errors


@pytest.mark.browser
def test_each_page_type_loads_without_console_errors(built, browser):
    """One page of each type, loaded from file://, with a screenshot each (into $FLASHKD_SCREENSHOTS when set)."""
    site = built["site"]
    vector = VECTOR["run"]["digest"].removeprefix("sha256:")[:16]
    torch_2 = next(p for p in (site / "compare").glob(f"{vector}-vs-*.html"))
    failed = next(p for p in (site / "runs").glob("*.html") if "Not ranked in its" in p.read_text("utf-8"))
    pages = {
        "index": site / "index.html",
        "run": site / "runs" / f"{torch_2.stem.split('-vs-')[1]}.html",
        "run-unranked": failed,
        "group": next(p for p in (site / "groups").glob("*.html") if "60.2416 ms" in p.read_text("utf-8")),
        "compare": torch_2,
        "compare-groups": next(p for p in (site / "compare").glob("*.html") if "Different comparison groups"
                               in p.read_text("utf-8")),
        "sweep": next(p for p in (site / "sweeps").glob("*.html") if "8192" in p.read_text("utf-8")),
    }
    shots = Path(os.environ.get("FLASHKD_SCREENSHOTS") or built["root"] / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    for kind, page in pages.items():
        assert browser.load(page.as_uri()) == [], f"{kind}: {page}"
        title = browser.call("Runtime.evaluate", session=True, returnByValue=True,
                             expression="document.title + '|' + getComputedStyle(document.body).margin")
        assert title["result"]["value"].endswith("|0px"), f"{kind}: the stylesheet did not apply"
        browser.screenshot(shots / f"{kind}.png")
        assert (shots / f"{kind}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.browser
def test_a_long_primary_value_stays_in_its_cell(browser, tmp_path, capsys):
    """A long "#1 primary" value ran into the group link beside it (a fixed column, no wrap)."""
    rows = _liger_csv().replace("60.24163055419922,60.24163055419922,60.24163055419922",
                                "123456789.125,123456789.125,123456789.125")
    (tmp_path / "rows.csv").write_text(rows)
    assert _cli(["records", "import-liger", str(tmp_path / "rows.csv"), "--out", str(tmp_path / "in")], capsys)[0] == 0
    assert _cli(["records", "site", str(tmp_path / "in"), "--out", str(tmp_path / "site")], capsys)[0] == 0
    index = tmp_path / "site" / "index.html"
    assert "123456789.1250 ms" in index.read_text("utf-8")
    for width in (1280, 900):
        browser.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=800,
                     deviceScaleFactor=1, mobile=False)
        assert browser.load(index.as_uri()) == []
        spilled = browser.call("Runtime.evaluate", session=True, returnByValue=True, expression="""
            [...document.querySelectorAll('table.groups td')]
              .filter(td => td.scrollWidth > td.clientWidth + 1).map(td => td.textContent)""")["result"]["value"]
        assert spilled == [], (width, spilled)


def test_an_out_that_cannot_be_made_is_one_line(tmp_path, capsys):
    """An OSError while the site is written (here --out under a regular file) was a traceback."""
    (tmp_path / "b").mkdir()
    shutil.copy(VECTOR_PATH, tmp_path / "b" / "v.json")
    (tmp_path / "plain").write_text("")
    code, out, err = _cli(["records", "site", str(tmp_path / "b"), "--out", str(tmp_path / "plain" / "site")], capsys)
    assert code == 2 and out == "" and err.startswith("flashkd records site: ") and err.count("\n") == 1, err
