"""The documentation's links resolve, the README stays a front page, and every
table of figures equals its regeneration from the result files.

Every relative Markdown link and image in ``README.md`` and ``docs/**/*.md`` must
point at a file or folder of the repository, and every ``#anchor`` (on the
same page or on another Markdown page) at a heading of that page, with
GitHub's rules for heading anchors. Links inside code (fenced blocks, inline
code spans) are not links. External links (``http:``, ``https:``,
``mailto:``) are not checked: the suite runs offline.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The README is the front page; the rest belongs in docs/.
README_MAX_LINES = 200

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
#: [text](target) and ![alt](target), with an optional "title".
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
#: [label]: target (reference definitions).
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:[^>]*\s)?(?:id|name)=\"([^\"]+)\"", re.I)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def doc_pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/ (docs/results/, docs/design/ too)."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, code spans blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, _CODE_SPAN.sub(lambda m: "`" + " " * len(m.group(2)) + "`",
                                               line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup dropped, lower case,
    punctuation removed (letters, digits, spaces, ``-`` and ``_`` kept),
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.replace("`", "").lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page defines: its headings' (duplicates numbered ``-1``,
    ``-2``, ... as GitHub does) and explicit ``<a id="...">`` / ``name=``."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = path.read_text(encoding="utf-8")
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(_HTML_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image of a page, outside code."""
    out = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        out += [(number, target) for target in _INLINE_LINK.findall(line)]
        reference = _REFERENCE.match(line)
        if reference:
            out.append((number, reference.group(1)))
    return out


def broken_links(pages: list[Path], root: Path = ROOT) -> list[str]:
    """One line per link that does not resolve: ``page:line: target (why)``."""
    problems = []
    root = root.resolve()
    for page in (p.resolve() for p in pages):
        for number, target in links(page):
            if _EXTERNAL.match(target):
                continue
            where = f"{page.relative_to(root)}:{number}: {target}"
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if root not in dest.parents and dest != root:
                problems.append(f"{where} (outside the repository)")
                continue
            if not dest.exists():
                problems.append(f"{where} (no such file or folder)")
                continue
            if anchor:
                if dest.suffix != ".md" or dest.is_dir():
                    problems.append(f"{where} (an anchor into a page that is not Markdown)")
                elif anchor not in anchors(dest):
                    problems.append(f"{where} (no heading or anchor #{anchor} in "
                                    f"{dest.relative_to(root)})")
    return problems


def test_every_readme_and_docs_link_resolves():
    problems = broken_links(doc_pages())
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move material to docs/")


def test_the_check_finds_broken_links_and_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text(
        "# Other page\n\n## Run `mpidp train`, again!\n\n## Run `mpidp train`, again!\n"
        '<a id="custom"></a>\n```sh\n# not a heading\n```\n', encoding="utf-8")
    (tmp_path / "code.py").write_text("", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "# Title\n\n"
        "[ok](docs/other.md) [ok](docs/other.md#other-page) [ok](docs/) [ok](code.py)\n"
        "[ok](docs/other.md#run-mpidp-train-again) [ok](docs/other.md#run-mpidp-train-again-1)\n"
        "[ok](docs/other.md#custom) [ok](#title) ![ok](code.py \"title\") [ok](https://x.org/y)\n"
        "[`code` in text](code.py)\n"
        "[missing file](docs/missing.md)\n"
        "[missing anchor](docs/other.md#no-such-heading)\n"
        "[heading in code](docs/other.md#not-a-heading)\n"
        "[same page](#nowhere)\n"
        "![missing image](img/none.png)\n"
        "[anchor into code](code.py#L1)\n"
        "[outside](../../etc/passwd)\n"
        "`[in code](docs/missing-too.md)`\n"
        "```\n[in a fence](docs/missing-too.md)\n```\n"
        "[ref]: docs/missing-ref.md\n", encoding="utf-8")
    problems = broken_links([page, tmp_path / "docs" / "other.md"], root=tmp_path)
    targets = [p.split(": ", 1)[1].split(" (")[0] for p in problems]
    assert targets == ["docs/missing.md", "docs/other.md#no-such-heading",
                       "docs/other.md#not-a-heading", "#nowhere", "img/none.png",
                       "code.py#L1", "../../etc/passwd", "docs/missing-ref.md"], problems
    assert all(p.startswith("README.md:") for p in problems)


def test_anchors_follow_githubs_rules():
    assert slug("Algorithms and channels") == "algorithms-and-channels"
    assert slug("`mpidp bench allreduce`") == "mpidp-bench-allreduce"
    assert slug("When calls disagree, and when a rank fails") == \
        "when-calls-disagree-and-when-a-rank-fails"
    assert slug("Time to accuracy: mlbench task 2a") == "time-to-accuracy-mlbench-task-2a"
    assert slug("Run under `mpiexec` or `srun`") == "run-under-mpiexec-or-srun"
    assert slug("B = 4096") == "b--4096"
    assert slug("shm_pair and [p2p](x.md)") == "shm_pair-and-p2p"


def test_the_gpu_page_shows_the_tables_its_result_files_give():
    """docs/gpus.md's figures are rendered from results/ by tools/gpu_tables.py,
    never edited by hand: regenerating them changes nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_tables", ROOT / "tools/gpu_tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    page = (ROOT / "docs/gpus.md").read_text(encoding="utf-8")
    shown = page.split(tables.BEGIN, 1)[1].split(tables.END, 1)[0]
    folder = re.search(r"\(results/(gpu-[\w.-]+)/\)", shown).group(1)
    assert shown == "\n" + tables.render(ROOT / "results" / folder)


def test_the_groups_page_shows_the_tables_its_result_files_give():
    """docs/groups.md's per-task figures are rendered from results/ by
    tools/group_table.py, never edited by hand; the result files hold no group
    below the threshold they state."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("group_table", ROOT / "tools/group_table.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    folder = ROOT / "results" / "groups-2026-11-27"
    page = (ROOT / "docs/groups.md").read_text(encoding="utf-8")
    shown = page.split(tables.BEGIN, 1)[1].split(tables.END, 1)[0]
    assert shown == "\n" + tables.render(folder.relative_to(ROOT))
    for task in tables.TASKS:
        document = json.loads((folder / f"{task}.json").read_text())["eval"]
        for table in document["by"]:
            assert all(g["rows"] >= document["min_group_size"] for g in table["groups"])


def _tool(name: str):
    import importlib.util

    import sys

    if name not in sys.modules:  # registered first: its dataclasses look it up
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_the_results_pages_show_the_tables_their_result_files_give():
    """README.md's table and docs/results*'s are rendered from results/ by
    tools/results_report.py, never edited by hand: regenerating them changes
    nothing, and every table has its markers on its page."""
    problems = _tool("results_report").stale()
    assert not problems, ("run `python tools/results_report.py`:\n" + "\n".join(problems))


def test_the_results_report_replaces_only_between_its_markers(tmp_path, monkeypatch):
    report = _tool("results_report")
    page = tmp_path / "page.md"
    monkeypatch.setattr(report, "TABLES", [report.Table("t", page, lambda p: "| a |\n|---|")])
    text = ("# Page\n\nprose\n<!-- results: t begin -->\nold\n<!-- results: t end -->\n"
            "more prose\n<!-- results: other begin -->\nx\n<!-- results: other end -->\n")
    new, problems = report.rendered(page, text)
    assert new == ("# Page\n\nprose\n<!-- results: t begin -->\n\n| a |\n|---|\n\n"
                   "<!-- results: t end -->\nmore prose\n<!-- results: other begin -->\nx\n"
                   "<!-- results: other end -->\n")
    assert problems == [f"{page}: no table 'other' renders here"]
    assert report.rendered(page, "# Page\n")[1][0].endswith("no markers for table 't'")


def test_result_files_name_their_command_date_and_machine():
    """Every result file a results table reads says how it was made."""
    report = _tool("results_report")
    for entries in report.MEASURE.values():
        for pattern, _ in entries:
            for path in sorted(ROOT.glob(pattern)) if pattern else []:
                made = report.provenance(report.load(path))
                assert made.get("machine") and made.get("command") and made.get("date"), path
