"""Every test that docs/bad-input.md and docs/vllm-bugs.md name as covering a case exists.

Regression (issue 30): docs/bad-input.md cited
``test_config.py::test_disk_path_that_is_a_file_is_refused``, a test that did not exist, for
a behaviour the README also described wrongly (a ``ValueError``; the store raises
``StorePathError`` when it opens).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
DOCS = ("docs/bad-input.md", "docs/vllm-bugs.md")
# `rel/test_x.py::test_name[param]`, `tests/scheduler/test_x.py`, `test_x.py` (bad-input.md:
# paths relative to tests/, rel/ = tests/reliability/)
REFERENCE = re.compile(r"`((?:[\w.-]+/)*test_\w+\.py)(?:::(\w+))?")


def references(text: str) -> list[tuple[str, str]]:
    return REFERENCE.findall(text)


def resolve(path: str) -> Path | None:
    """The test file ``path`` names: relative to the repository, to tests/ (``rel/`` is
    tests/reliability/), or a file name found once under tests/."""
    for candidate in (ROOT / path, TESTS / path, TESTS / re.sub(r"^rel/", "reliability/", path)):
        if candidate.is_file():
            return candidate
    found = list(TESTS.rglob(Path(path).name)) if "/" not in path else []
    return found[0] if len(found) == 1 else None


def test_references_are_parsed_with_their_test_names():
    text = ("`rel/test_a.py::test_b[x-y]`, `tests/scheduler/test_c.py`, `test_config.py::"
            "test_d`, `bad_input/test_e.py::test_f`")
    assert references(text) == [("rel/test_a.py", "test_b"), ("tests/scheduler/test_c.py", ""),
                                ("test_config.py", "test_d"), ("bad_input/test_e.py", "test_f")]


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_test_exists(doc):
    refs = references((ROOT / doc).read_text())
    assert refs
    missing = []
    for path, name in refs:
        file = resolve(path)
        if file is None:
            missing.append(path)
        elif name and not re.search(rf"^(?:async )?def {name}\(", file.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"{doc} names tests that do not exist: {missing}"
