"""The README stays a first read (short, its reference in docs/), .ci/run still finds its test command, and no
link in the README or docs/ points at a file that is not there."""

import ast
import builtins
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
# [text](target) with an optional "title"; images too. Autolinks and reference-style links are not used here.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _links(path):
    """(line number, target) of each inline link of a Markdown file, outside fenced code blocks."""
    found, fenced = [], False
    for number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            found += [(number, target) for target in LINK.findall(re.sub(r"`[^`]*`", "", line))]
    return found


def test_readme_is_short():
    lines = README.read_text("utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference text into docs/"


def test_docs_has_its_pages():
    names = {p.name for p in PAGES}
    assert len(PAGES) >= 3, names
    assert {"api.md", "forms.md", "integrations.md", "distributed.md", "memory.md", "backends.md",
            "records.md"} <= names


def test_readme_links_every_docs_page():
    targets = {target.split("#")[0] for _, target in _links(README)}
    assert [p.name for p in PAGES if f"docs/{p.name}" not in targets] == []


@pytest.mark.parametrize("path", [README, REPO / "BENCHMARKS.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(path):
    broken = []
    for number, target in _links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor within the page
        file = (path.parent / target.split("#")[0]).resolve()
        if not file.exists() or REPO not in (file, *file.parents):
            broken.append(f"{path.relative_to(REPO)}:{number}: {target}")
    assert broken == []


def test_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[here](gone.md) and [there](page.md#x) `[no](code.md)`\n```\n[no](fenced.md)\n```\n")
    assert _links(page) == [(1, "gone.md"), (1, "page.md#x")]


def test_readme_keeps_the_test_command_marker():
    """.ci/run runs the first non-comment line of the code block after this marker, verbatim."""
    lines = README.read_text("utf-8").splitlines()
    marker = "<!-- test-command: .ci/run runs the next line -->"
    assert marker in lines
    block = lines[lines.index(marker) + 1:]
    assert block[0] == "```bash"
    command = next(line for line in block[1:] if not line.startswith("#"))
    assert "-e \".[test]\"" in command and command.endswith("-m pytest -q"), command


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_docs_snippets_are_python_that_names_what_it_uses(path):
    """Each ```python block of a docs page parses, and every name it reads is imported, assigned, a
    builtin, or the user's own, named on its `# yours: a, b` line."""
    text = path.read_text("utf-8")
    for code in re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S):
        tree = ast.parse(code)
        known = set(dir(builtins))
        known |= {n.strip() for names in re.findall(r"^# yours: (.*)$", code, re.M) for n in names.split(",")}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                known |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                known.add(node.name)
            elif isinstance(node, ast.arg):
                known.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                known.add(node.id)
        read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert read <= known, f"{path.name}: {sorted(read - known)} neither imported nor marked as yours"


def test_the_docs_say_how_to_run_the_command_before_they_run_it():
    """The README's commands install into .venv/ without activating it, and the docs' blocks typed a bare
    `flashkd`: command not found. The README says how once; a page says it before its first such block."""
    readme = README.read_text("utf-8")
    assert ".venv/bin/flashkd" in readme and "source .venv/bin/activate" in readme
    for path in PAGES:
        text = path.read_text("utf-8")
        runs = re.search(r"^```(?:bash|sh|console)?\n(?:[^`]*?\n)?(?:\$ )?flashkd ", text, re.M)
        if runs:
            assert "source .venv/bin/activate" in text[:runs.start()], path.name
