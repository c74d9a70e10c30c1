"""Where the repository's files are, for tests at any depth of tests/."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
DOCS = ROOT / "docs"
