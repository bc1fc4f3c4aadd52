"""The project speaks of the product only: no words from how its development was organised.

"session 17", "issue-17", "an earlier session's figure", "found in review" mean nothing to a
reader of the code or of BENCHMARKS.md; a figure names its machine, ISA, date and command, a
test says what it checks. Every text file of the repository is scanned (git's tracked and
untracked-but-not-ignored files, or the tree when git is absent), this file excepted.

The product has sessions of its own (RPC sessions, onnxruntime's InferenceSession, the
server's session process), so the patterns stay narrow: a number after "session" counts unless
it is the ``rpc session 0`` of ``hgrt.rpc.describe``; a bare "this/next/earlier... session" counts,
so product text that means an RPC or server session says so ("this RPC session").
"""

from __future__ import annotations

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.relpath(os.path.abspath(__file__), ROOT)
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", "build", "dist", "out", "tuning",
             ".pytest_cache", ".ruff_cache", ".hypothesis", "shared"}
BINARY = (".png", ".jpg", ".jpeg", ".gif", ".pdf", ".so", ".o", ".a", ".onnx", ".pyc", ".npy",
          ".npz", ".tar", ".gz", ".zip", ".params", ".bin")

# Between two words: spaces, or a line break and the next line's comment marker.
SEP = r"\s+(?:(?:#+|//+|\*|>)\s+)?"
# A number right after the word, as in "session 22", "session-19", "issues #12", "(session\n23)".
NUMBER = r"(?:-|" + SEP + r")#?\d+"

PATTERNS = [
    # "session 17", "(session 23)", "session-19 bullet"; not "rpc session 0" (describe()'s
    # words for an RPC session) and not "--max-session 5" / "max_session=3".
    ("a numbered session", r"(?<![\w-])(?<!rpc )sessions?" + NUMBER),
    ("a numbered issue", r"(?<![\w-])issues?" + NUMBER),
    # a session of the development work; the product's say which: "this RPC session".
    ("a session of the work",
     r"\b(?:earlier|previous|prior|last|next|later|this|another|other)"
     r"(?:" + SEP + r"(?:two|three|few|several|\d+))?" + SEP + r"sessions?\b"),
    ("a session of the work", r"\bsessions" + SEP + r"since\b"),
    ("a session of the work", r"\bsession" + SEP + r"to" + SEP + r"session\b"),
    ("a session of the work", r"\bin" + SEP + r"the" + SEP + r"session" + SEP + r"(?:of|that)\b"),
    ("a review of the work", r"\bfound" + SEP + r"in" + SEP + r"review\b"),
    ("a review of the work", r"\breview" + SEP + r"(?:\(\s*session|mends?\b)"),
    ("a review of the work", r"\breviewers?\b"),
    ("an issue of the work", r"\bthe" + SEP + r"issue(?:'s)?\b"),
]
COMPILED = [(name, re.compile(rx, re.IGNORECASE)) for name, rx in PATTERNS]


def repo_files() -> list[str]:
    """Paths relative to ROOT: git's tracked and untracked-but-not-ignored files, else a walk."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True, check=True,
                             timeout=60).stdout
        files = sorted({p for p in out.decode().split("\0") if p})
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names]
    return sorted(files)


def text_of(path: str) -> str | None:
    """The file's text, or None for a binary file, a missing one or a link to a folder."""
    if path.lower().endswith(BINARY):
        return None
    try:
        with open(os.path.join(ROOT, path), "rb") as f:
            data = f.read()
    except OSError:  # deleted in the work tree, a folder (a submodule), unreadable
        return None
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def hits(text: str) -> list[tuple[int, str, str]]:
    """(line number, pattern name, the line) of every match, in order, one per line."""
    found = {}
    for name, rx in COMPILED:
        for m in rx.finditer(text):
            line = text.count("\n", 0, m.start())
            found.setdefault(line, name)
    lines = text.split("\n")
    return [(n + 1, name, lines[n].strip()) for n, name in sorted(found.items())]


def scan() -> list[str]:
    report = []
    for path in repo_files():
        if os.path.normpath(path) == os.path.normpath(HERE):
            continue  # this file spells the patterns out
        text = text_of(path)
        if text is None:
            continue
        report += [f"{path}:{n}: [{name}] {line[:160]}" for n, name, line in hits(text)]
    return report


def test_the_patterns_tell_the_work_from_the_product():
    work = ["measured in session 17", "(session 23)", "the session-19 bullet", "Session 20's rule",
            "the issue-17 check", "Serving (issue 19)", "issues #12", "an earlier session's figure",
            "in two other runs this session", "the table of the previous session",
            "for the next session", "found in review", "review (session 22)",
            "after the review mends", "unlike the Xeon of earlier\nsessions",
            "an earlier\n    # session", "over the sessions since", "in the session of x",
            "in a reviewer's test", "the issue's target", "runs of the last two sessions",
            "the CPU varies from session to session"]
    product = ["'rpc session 0 (tracker 127.0.0.1:9190)'", 'f"rpc session {index}"',
               "RPC session", "this RPC session", "a tensor of this RPC session",
               "the server's session process", "ort.InferenceSession(model)",
               "an onnxruntime session", "--max-session 5", "max_session=3.0",
               "from hgrt.rpc import session as sessions", "rpc/session.py",
               "a second module in the same session", "end any session after this long",
               "in ONE session", "sessions are served one at a time", "issues a call",
               r'match=r"rpc session \d+ \(tracker"']
    assert [w for w in work if not hits(w)] == []
    assert [(p, hits(p)) for p in product if hits(p)] == []


def test_no_development_words():
    found = scan()
    assert not found, ("words of the development work, not of the product (say what is measured "
                       "or tested: machine, ISA, date, command; an RPC session says 'RPC "
                       "session'):\n" + "\n".join(found))
