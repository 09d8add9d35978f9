"""The docs point at what exists: links, pages named in code, tests named on pages."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
CODE = [p for folder in ("rrfp", "torchtitan_ext", "benchmarks", "tests")
        for p in sorted((ROOT / folder).rglob("*.py"))]

LINK = re.compile(r"\]\(([^)\s]+)\)")
DOCS_PATH = re.compile(r"docs/[\w/.-]+?\.md")
NAMED_TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")
# Docs say what is; a page that tells how the code changed goes stale with the next change.
HISTORY = re.compile(r"before this release|this release's change|earlier version|"
                     r"\bused to\b|\bno longer\b|\bpreviously\b", re.IGNORECASE)


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        if not (page.parent / path).exists():
            broken.append(f"{page.relative_to(root)} -> {target}")
    return broken


def missing_tests(page: Path, root: Path = ROOT) -> list[str]:
    missing = []
    for file, name in NAMED_TEST.findall(page.read_text()):
        source = root / file
        if not source.exists() or not re.search(rf"^def {name}\(", source.read_text(), re.M):
            missing.append(f"{page.relative_to(root)} names {file}::{name}")
    return missing


def test_every_relative_link_on_a_page_leads_to_a_file():
    assert [b for page in PAGES for b in broken_links(page)] == []


def test_every_page_the_code_names_exists():
    missing = [f"{source.relative_to(ROOT)}: {path}" for source in CODE
               for path in DOCS_PATH.findall(source.read_text()) if not (ROOT / path).exists()]
    assert missing == []


def test_every_results_page_names_the_benchmark_that_wrote_it():
    unnamed = []
    for page in sorted((ROOT / "benchmarks" / "results").glob("*.md")):
        modules = re.findall(r"python -m benchmarks\.(\w+)", page.read_text())
        if not modules or not all((ROOT / "benchmarks" / f"{m}.py").exists() for m in modules):
            unnamed.append(page.name)
    assert unnamed == []


def test_every_page_is_listed_by_reader_in_the_docs_index():
    index = (ROOT / "docs" / "README.md").read_text()
    listed = {(ROOT / "docs" / target.split("#")[0]).resolve() for target in LINK.findall(index)}
    unlisted = [str(page.relative_to(ROOT)) for page in PAGES[1:]
                if page.name != "README.md" and page.resolve() not in listed]
    assert unlisted == []


def test_every_test_a_page_names_exists():
    assert [m for page in PAGES for m in missing_tests(page)] == []


def test_pages_say_what_is_not_how_it_changed():
    found = [f"{page.relative_to(ROOT)}:{number}: {line.strip()}" for page in PAGES
             for number, line in enumerate(page.read_text().splitlines(), 1)
             if HISTORY.search(line)]
    assert found == []


def test_the_checks_find_what_is_broken(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_there():\n    pass\n")
    page = tmp_path / "page.md"
    page.write_text("[a](missing.md) [b](page.md#x) [c](https://x.org) [d](#top)\n"
                    "tests/test_x.py::test_there tests/test_x.py::test_gone\n")
    assert broken_links(page, tmp_path) == ["page.md -> missing.md"]
    assert missing_tests(page, tmp_path) == ["page.md names tests/test_x.py::test_gone"]
    assert HISTORY.search("It no longer waits") and not HISTORY.search("It waits")
