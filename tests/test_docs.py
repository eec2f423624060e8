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


# ---- the docs say what the code does -------------------------------------------------------------

PACKAGE = ROOT / "zerojax"
# a placeholder in a quoted message: "...", a number, an upper-case name (N, DIR, SIGKILL)
PLACEHOLDER = r"\.\.\.|\d+|\b[A-Z][A-Z_]*\b"


def quoted_errors(text: str) -> list[str]:
    """The error messages a page quotes: `error: ...` spans, and the span in parentheses after `UserError`."""
    text = re.sub(r"\s+", " ", text)
    spans = re.findall(r"`((?:[a-z]+: )?error: [^`]+)`", text) + re.findall(r"UserError` \(`([^`]+)`", text)
    return [re.sub(r"^(?:[a-z]+: )?error: ", "", s) for s in spans if s.strip() not in ("error: ...", "error:")]


def message_fragments(message: str) -> list[str]:
    """The literal parts of a quoted message between its placeholders and punctuation (where the code
    may join pieces it composes), three words or more: long enough to be telling."""
    pieces = [p.strip() for f in re.split(PLACEHOLDER, message) for p in re.split(r"[;:(),]", f)]
    return [p for p in pieces if len(_words(p)) >= 3]


def _words(text: str) -> list[str]:
    return re.findall(r"[\w=.'-]+|\0", text)


def _strings(path: pathlib.Path) -> list[list[str]]:
    """Every string in a module as words, each field of an f-string one wildcard word (a NUL)."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else " \0 " for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return [_words(s) for s in out]


def said_in(fragment: str, strings: list[list[str]]) -> bool:
    """Whether some string of the code reads `fragment`, a field standing for any one word."""
    want = _words(fragment)
    return any(
        all(w == h or h == "\0" for w, h in zip(want, have[i : i + len(want)]))
        for have in strings
        for i in range(len(have) - len(want) + 1)
    )


@pytest.fixture(scope="module")
def source_strings() -> list[list[str]]:
    return [s for path in sorted(PACKAGE.rglob("*.py")) for s in _strings(path)]


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_error_message_a_page_quotes_is_still_in_the_code(page, source_strings):
    missing = [
        fragment
        for message in quoted_errors(page.read_text(encoding="utf-8"))
        for fragment in message_fragments(message)
        if not said_in(fragment, source_strings)
    ]
    assert not missing


def test_the_quoted_message_check_reads_both_forms_and_finds_a_changed_message(source_strings):
    text = "one `error: training stopped at step N: ...` line\nor a `UserError` (`a rule maps to nowhere at\nall`)."
    assert quoted_errors(text) == ["training stopped at step N: ...", "a rule maps to nowhere at all"]
    assert message_fragments("training stopped at step N: ...") == ["training stopped at step"]
    assert said_in("training stopped at step", source_strings)
    assert said_in("which the tpu backend cannot place", source_strings)  # a field stands for one word
    assert not said_in("a rule maps to nowhere at all", source_strings)


def _map_and_modules() -> tuple[set[str], set[str]]:
    """(the modules docs/architecture.md names, by their path in zerojax/; the package's modules)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    found = re.findall(r"`((?:zerojax/)?[\w/]+\.py)`", text)
    named = {n.removeprefix("zerojax/") for n in found if not n.startswith("tests/")}
    files = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    return named, files


def test_every_module_the_map_of_the_code_names_exists():
    named, files = _map_and_modules()
    assert not sorted(named - files)


def test_every_module_of_the_package_is_on_the_map():
    named, files = _map_and_modules()
    assert not sorted(f for f in files - named if not f.endswith("__init__.py") or f == "engines/__init__.py")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_module_path_a_page_names_exists(page):
    named = re.findall(r"\b(zerojax/[\w/]+\.py)\b", page.read_text(encoding="utf-8"))
    assert not sorted({n for n in named if not (ROOT / n).exists()})


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_zj_name_a_page_uses_is_exported(page):
    import zerojax as zj

    named = set(re.findall(r"\bzj\.([A-Za-z_]\w*)", page.read_text(encoding="utf-8")))
    assert not sorted(n for n in named if not hasattr(zj, n))
