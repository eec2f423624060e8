"""The README and docs/ hang together: every relative link and anchor resolves, every docs page is
linked from the README, and the README stays a short page that keeps CI's test command."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
TEST_COMMAND = '```bash\npython3 -m pip install -e ".[test]" && python3 -m pytest -q\n```'
TRAIN_COMMAND = (
    "```bash\npython3 -m pip install -e . && zerojax train configs/tiny.yaml --devices 8 --out runs/tiny\n```"
)


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def links(text: str) -> list[str]:
    """Targets of the Markdown links and images, outside code."""
    prose = re.sub(r"`[^`\n]*`", "", "\n".join(_prose(text)))
    return re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose)


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    found, seen = set(), {}
    for line in _prose(text):
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


def _broken(page: pathlib.Path) -> list[str]:
    broken = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{target}: no such heading")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_points_to_an_existing_file_and_heading(page):
    assert not _broken(page)


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: yes\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-code-heading-yes) [file](missing.md) [head](other.md#nope) [web](https://x.org)\n"
        "`[code](missing.md)`\n```\n[fenced](missing.md)\n```\n"
    )
    assert _broken(page) == ["missing.md: no such file", "other.md#nope: no such heading"]


def test_anchors_number_repeated_headings():
    assert anchors("## Measured\n### Measured\n## The planner's picks\n") == {
        "measured",
        "measured-1",
        "the-planners-picks",
    }


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links(README.read_text(encoding="utf-8"))}
    assert not [_rel(page) for page in DOCS if page.resolve() not in linked]


def test_the_readme_is_short_and_keeps_the_two_set_up_commands():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 200
    assert TRAIN_COMMAND in text
    assert TEST_COMMAND in text
