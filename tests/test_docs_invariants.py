"""Every "invariant N" the code, tests and docs cite is written, numbered, in
docs/architecture.md ("Invariants"), and every test that section names exists.

Regression: ten places cited invariants 1-9 while no file in the repository numbered
them (issue 30), so a reader could not look one up and a wrong number went unnoticed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
CITING_TREES = ("kv_offload", "tests", "docs")
CITATION = re.compile(r"\binvariants?\s+(\d+(?:\s*(?:-|,|and)\s*\d+)*)", re.IGNORECASE)


def invariants_section(text: str) -> str:
    start = text.index("\n## Invariants\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def numbered_invariants(section: str) -> list[int]:
    return [int(n) for n in re.findall(r"^(\d+)\. \*\*", section, re.MULTILINE)]


def cited_numbers(text: str) -> set[int]:
    numbers: set[int] = set()
    for match in CITATION.finditer(text):
        for part in re.split(r"\s*(?:,|and)\s*", match.group(1)):
            low, _, high = part.partition("-")
            numbers.update(range(int(low), int(high or low) + 1))
    return numbers


def citing_files() -> list[Path]:
    files = [p for tree in CITING_TREES for p in (ROOT / tree).rglob("*")
             if p.suffix in (".py", ".md") and p.is_file()]
    return sorted(p for p in files if p != Path(__file__).resolve())


def test_citations_are_parsed_with_ranges_and_lists():
    assert cited_numbers("pins (invariants 1-2), blocks (invariant 3)") == {1, 2, 3}
    assert cited_numbers("Covers invariants 1 and 2, and Invariant 9.") == {1, 2, 9}
    assert cited_numbers("the invariants below") == set()


def test_the_invariants_are_numbered_from_one_without_gaps():
    numbers = numbered_invariants(invariants_section(ARCHITECTURE.read_text()))
    assert numbers == list(range(1, len(numbers) + 1)) and numbers


def test_every_cited_invariant_is_written_in_the_architecture_doc():
    written = set(numbered_invariants(invariants_section(ARCHITECTURE.read_text())))
    missing = {str(p.relative_to(ROOT)): sorted(cited_numbers(p.read_text()) - written)
               for p in citing_files()}
    missing = {path: numbers for path, numbers in missing.items() if numbers}
    assert not missing, (f"cited invariants that docs/architecture.md ('Invariants') does "
                         f"not number: {missing}; write them there or fix the citation")


def test_the_tests_the_invariants_name_exist():
    section = invariants_section(ARCHITECTURE.read_text())
    named_files = set(re.findall(r"`(tests/[\w/]+\.py)`", section))
    named_tests = set(re.findall(r"`(test_\w+)`", section))
    for name in named_files:
        assert (ROOT / name).is_file(), f"docs/architecture.md names missing {name}"
    defined = {m for p in (ROOT / "tests").rglob("test_*.py")
               for m in re.findall(r"^def (test_\w+)", p.read_text(), re.MULTILINE)}
    assert named_tests <= defined, (
        f"docs/architecture.md ('Invariants') names tests that do not exist: "
        f"{sorted(named_tests - defined)}")
