"""Where the tests find the repository's files: fixtures, configs, docs."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(REPO, "tests", "fixtures")
CONFIGS = os.path.join(REPO, "configs")
DOCS = os.path.join(REPO, "docs")


def fixture_path(name: str) -> str:
    """``tests/fixtures/<name>``."""
    return os.path.join(FIXTURES, name)
