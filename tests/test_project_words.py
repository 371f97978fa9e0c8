"""The project speaks of its versions, dates and commits: its text (README, docs, code, benchmarks, prompts' docs)
never names a working session or an issue number, which a reader of the project does not have."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["README.md", "docs/**/*.md", "llmprobe/**/*.py", "llmprobe/**/*.toml", "synthetic/**/*.py",
         "benchmarks/**/*.py", "benchmarks/**/*.sh", "prompts/*.md", "prompts/*.py"]
FORBIDDEN = re.compile(r"\bsessions?\b|\bissues? ?#?\d+|\bthe issue\b|\bthe issue's\b", re.IGNORECASE)


def offending_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if FORBIDDEN.search(line)]


def test_no_sessions_or_issue_numbers():
    found = {}
    for pattern in TEXTS:
        for path in ROOT.glob(pattern):
            hits = offending_lines(path.read_text(encoding="utf-8"))
            if hits:
                found[str(path.relative_to(ROOT))] = hits[:3]
    assert not found, f"text that names sessions or issues: {found}"


def test_the_check_sees_what_it_forbids():
    """The pattern catches the phrasings that were there before (a loosened pattern would pass anything)."""
    for line in ("the session before", "as in issue 20", "Issue #48 asks", "the issue's 1.3x", "third Session"):
        assert offending_lines(line), line
    for line in ("a Ray cluster", "the report's issues list", "decisions", "the version of d984ce0"):
        assert not offending_lines(line), line
