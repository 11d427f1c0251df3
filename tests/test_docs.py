"""The docs are a reference: no diary outside docs/history/, links that resolve, history linked.

docs/ (but docs/history/ and docs/adr/) says what is true now: what a component is, how to use
it, its settings, metrics, costs and limits. How a figure was found, what an earlier round of
an issue did or what was tried and dropped lives in docs/history/, one page per component,
linked from the reference page it belongs to. These tests keep it so:

- no reference page, nor the README, reads as a lab notebook (``round 20``, ``the twentieth
  round``, ``the eighth round of issue 15``, ``this session``);
- every relative Markdown link in README.md and docs/ points at a file that exists (and, where
  it names an anchor, at a heading of that file), and so does every ``docs/….md`` path named in
  the text;
- docs/history/ exists and each of its pages is linked from a reference page or the README.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
HISTORY = DOCS / "history"
#: Folders of docs/ that are records, not reference: the diary rule does not apply there.
ARCHIVES = (HISTORY, DOCS / "adr")

#: Ordinals a round of work is counted with: from the third on (a bench's first and second round
#: of arms are its own), and every compound (twenty-first, 21st).
_ORDINAL = (
    r"(?:third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\w+teenth"
    r"|\w+tieth|\w+-(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
    r"|\d+(?:st|nd|rd|th))"
)
#: Phrases of a lab notebook: a round of work, a session, said where a reference says what is.
DIARY = tuple(
    re.compile(pattern, re.IGNORECASE)
    for pattern in (
        r"(?<![\w-])rounds?\s+\d+",  # round 20, round 20's tree (not a bench's --rounds 20)
        rf"\b{_ORDINAL}\s+rounds?\b",  # the twentieth round, Twenty-first round (below, ...)
        r"\bthe\s+(?:last|previous|next)\s+round\b",  # a machine slower than the last round's
        r"\bround\s+of\s+issue\b",  # the first round of issue 15
        r"\b(?:this|that)\s+(?:round|session)\b",  # built this round, that session's machine
        r"\b(?:next|previous)\s+(?:GPU\s+)?session\b",  # for the next GPU session
    )
)

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_DOC_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]+?\.md\b")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def markdown_files() -> list[Path]:
    """README.md and every page under docs/, history and ADRs included."""
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def reference_pages() -> list[Path]:
    """The pages of docs/ that must read as a reference (not docs/history/, not docs/adr/)."""
    return [
        path
        for path in sorted(DOCS.rglob("*.md"))
        if not any(path.is_relative_to(folder) for folder in ARCHIVES)
    ]


def prose(text: str) -> str:
    """``text`` without fenced code blocks (kept as blank lines: line numbers still hold)."""
    return _FENCE.sub(lambda match: "\n" * match.group(0).count("\n"), text)


def diary_phrases(text: str) -> list[tuple[int, str]]:
    """(line number, phrase) for each diary phrase in ``text``, code blocks included; a phrase
    may wrap onto the next line."""
    found = [
        (text.count("\n", 0, match.start()) + 1, " ".join(match.group(0).split()))
        for pattern in DIARY
        for match in pattern.finditer(text)
    ]
    return sorted(found)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = _CODE_SPAN.sub(lambda match: match.group(0).strip("`"), heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of ``path``'s headings, a repeated heading numbered as GitHub does."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for heading in _HEADING.findall(prose(path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[tuple[str, str]]:
    """(target, anchor) of each relative Markdown link in ``path``, outside code."""
    text = _CODE_SPAN.sub("", prose(path.read_text()))
    found: list[tuple[str, str]] = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
            continue  # https:, mailto:, ...
        file_part, _, anchor = target.partition("#")
        found.append((file_part, anchor))
    return found


def resolve(path: Path, target: str) -> Path:
    """A link's target, relative to the page that holds it (itself when empty)."""
    return path if not target else (path.parent / target).resolve()


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


def test_the_diary_patterns_catch_the_notebook_and_spare_ordinary_words() -> None:
    notebook = (
        "The twentieth round took ~17 µs off a timed step, the twenty-first ~650 instructions",
        "`OTEL_METRIC_EXPORT_INTERVAL` ms | 10.0 s (1 s before the eighth round of issue 15)",
        "### C fast paths (issue 15, fifth round)",
        "| cfbd1f3 (round 20) | 16.9, 7.5 |",
        "against 10.7 for round 20's tree",
        "This session was lent an NVIDIA H100 80GB for 15 minutes",
        "Measured this round, the hooks' own Python was more than that.",
        "(0.05 % until the twenty-second round, 0.1 % before)",
        "- Nineteenth round, on this VM: 20 more runs of `bench/step_segments.py`",
        "That session's machine ran ~1.4x slower; on a machine slower than the last round's",
        "`--parts cupti` now times the same launches, for the next GPU session",
        "every 10 s by default since the eighth\nround, every second before",
    )
    ordinary = (
        "each request is one network round-trip; values are rounded to 12 significant bits",
        "DNS round robin or an L4 load balancer in front of the bridges",
        "1,500 rounds a run, medians of 3 interleaved rounds, the first round left out",
        "bench/step_split.py --rounds 10000 --batch 128; the second round of two",
        "round the figure up to the next power of two",
        "a profiling session of torch.profiler; TLS session resumption; the last session key",
        "issue 15 set the goal at 0.1 % of a 20 ms step",
    )
    for line in notebook:
        assert diary_phrases(line), line
    for line in ordinary:
        assert not diary_phrases(line), (line, diary_phrases(line))


@pytest.mark.parametrize("page", [REPO / "README.md", *reference_pages()], ids=relative)
def test_reference_pages_read_as_a_reference_not_a_diary(page: Path) -> None:
    found = diary_phrases(page.read_text())
    assert not found, (
        f"{relative(page)} reads as a diary; say what is true now and move how it was found to "
        f"docs/history/: " + "; ".join(f"line {number}: {phrase!r}" for number, phrase in found)
    )


@pytest.mark.parametrize("page", markdown_files(), ids=relative)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target, anchor in links(page):
        resolved = resolve(page, target)
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}#{anchor}: no such heading in {relative(resolved)}")
    assert not broken, f"{relative(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", markdown_files(), ids=relative)
def test_named_doc_paths_exist(page: Path) -> None:
    """A page that names ``docs/x.md`` in its text (not a link) names a page that exists."""
    text = _LINK.sub("", page.read_text())  # links are the test above's (and may leave the repo)
    named = set(_DOC_PATH.findall(text))
    missing = sorted(name for name in named if not (REPO / name).exists())
    assert not missing, f"{relative(page)} names missing pages: {missing}"


def test_history_pages_exist_and_each_is_linked_from_a_reference_page() -> None:
    pages = sorted(HISTORY.glob("*.md"))
    assert pages, "docs/history/ holds no page"
    linked: set[Path] = set()
    for page in [REPO / "README.md", *reference_pages()]:
        linked.update(resolve(page, target) for target, _ in links(page) if target)
    unlinked = [relative(page) for page in pages if page.resolve() not in linked]
    assert not unlinked, f"history pages no reference page links: {unlinked}"
