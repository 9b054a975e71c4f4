"""The docs hold together: every relative link in README.md and docs/ reaches a file (and its heading,
when it names one), docs/README.md reaches every user page and every study in one click, the user pages
are not raw study outputs, and the README's test-suite figure is the one docs/measurements.md gives."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
STUDIES = DOCS / "studies"

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose(path: Path) -> str:
    """The page without its code (fenced blocks and inline spans), where a `](` is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", path.read_text()))


def links(path: Path) -> list[str]:
    """Relative link targets of a page (no http(s)/mailto), as written."""
    return [t for t in LINK.findall(prose(path)) if not re.match(r"[a-z]+:", t)]


def anchors(path: Path) -> set[str]:
    """The heading anchors GitHub makes for a page: lower case, punctuation dropped, spaces to
    hyphens, a repeated anchor numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def user_pages() -> list[Path]:
    """Every page under docs/ outside studies/, docs/README.md itself excepted."""
    return [p for p in sorted(DOCS.glob("*.md")) if p.name != "README.md"]


def linked_files(page: Path) -> set[Path]:
    return {(page.parent / t.split("#")[0]).resolve() for t in links(page) if not t.startswith("#")}


def test_every_relative_link_reaches_a_file_and_its_heading():
    broken = []
    for page in markdown_files():
        for target in links(page):
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_path_named_in_the_repository_exists():
    """`docs/...` named in text (the README, the docs, the tools' and tests' help and comments, the
    package's docstrings) names a file there: a moved page takes its mentions along."""
    named = re.compile(r"docs/[\w./<>*-]*[\w*>]")
    sources = [*markdown_files(), *(p for d in ("tools", "tests", "hexrl") for p in (ROOT / d).rglob("*")
                                    if p.suffix in (".py", ".sh", ".json", ".md"))]
    missing = []
    for source in sources:
        for path in set(named.findall(source.read_text())):
            pattern = re.sub(r"<[^>]*>", "*", path)
            if not (list(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists()):
                missing.append(f"{source.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def test_every_code_path_the_pages_name_exists():
    """A file of tools/, hexrl/, tests/ or kernels/ that the README, a user page or a study's README names
    exists: the commands they show still run after a move. (The studies' own outputs are records of
    what ran then, and are not checked.)"""
    named = re.compile(r"(?<![\w/.-])((?:tools|hexrl|tests|kernels)/[\w./<>*-]*\.\w+)")
    pages = [ROOT / "README.md", *DOCS.glob("*.md"), *STUDIES.glob("*/README.md")]
    missing = []
    for page in pages:
        for path in sorted(set(named.findall(page.read_text()))):
            pattern = re.sub(r"<[^>]*>", "*", path)
            if not (list(ROOT.glob(pattern)) if "*" in pattern else (ROOT / pattern).exists()):
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "\n".join(missing)


def test_the_index_reaches_every_user_page_and_every_study():
    index = linked_files(DOCS / "README.md")
    wanted = [*user_pages(), *(d / "README.md" for d in sorted(STUDIES.iterdir()) if d.is_dir())]
    missing = [str(p.relative_to(ROOT)) for p in wanted if p.resolve() not in index]
    assert not missing, f"not linked from docs/README.md: {missing}"


def test_every_study_has_a_readme_that_links_its_files():
    studies = [d for d in sorted(STUDIES.iterdir()) if d.is_dir()]
    assert studies, "docs/studies/ holds no study"
    problems = []
    for study in studies:
        readme = study / "README.md"
        if not readme.exists():
            problems.append(f"{study.relative_to(ROOT)}: no README.md")
            continue
        reached = linked_files(readme)
        problems += [f"{p.relative_to(ROOT)}: not linked from its study's README"
                     for p in sorted(study.rglob("*")) if p.is_file() and p != readme and p.resolve() not in reached]
    assert not problems, "\n".join(problems)


def test_user_pages_are_written_pages_not_study_outputs():
    """Outside studies/ docs/ holds only Markdown pages, none titled or sectioned by an issue number."""
    stray = [p.name for p in DOCS.iterdir() if p.name != "studies" and (p.is_dir() or p.suffix != ".md")]
    assert not stray, f"study outputs belong under docs/studies/<study>/: {stray}"
    by_issue = [f"{p.name}: {line}" for p in [DOCS / "README.md", *user_pages()]
                for line in FENCE.sub("", p.read_text()).splitlines()
                if line.startswith("#") and re.search(r"\bissues? \d", line, re.I)]
    assert not by_issue, "headings say what they explain, not which issue:\n" + "\n".join(by_issue)


def test_the_readme_suite_figure_is_the_measured_one():
    def suite_time(path: Path) -> str:
        rows = [x for x in path.read_text().splitlines() if x.startswith("|") and "test suite" in x]
        assert len(rows) == 1, f"{path.name}: one table row for the test suite, found {len(rows)}"
        found = re.search(r"\d+ min \d+ s", rows[0])
        assert found, f"{path.name}: the suite's row gives no 'N min M s': {rows[0]}"
        return found.group(0)

    assert suite_time(ROOT / "README.md") == suite_time(DOCS / "measurements.md")
