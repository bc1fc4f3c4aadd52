"""The project speaks of the product only: no words from how its development was organised.

A numbered session or issue of the work, a session of it ("an earlier one", "the next one") or a
review of it means nothing to a reader of the code or of BENCHMARKS.md; a figure names its
machine, ISA, date and command, a test says what it checks. Every text file of the repository
is scanned (git's tracked and untracked-but-not-ignored files, or the tree when git is absent),
this file excepted.

The product has sessions of its own (RPC sessions, onnxruntime's InferenceSession, the
server's session process), so the patterns stay narrow: a number after the word counts unless
"rpc" comes before it (``hgrt.rpc.describe``'s name for an RPC session); a session qualified by
this/next/earlier... counts, so product text that means an RPC or server session says so ("this
RPC session"). The examples below are written with placeholders for the same reason.
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
# A number right after the word: after spaces, a dash, a "#", or a line break and a comment mark.
NUMBER = r"(?:-|" + SEP + r")#?\d+"

PATTERNS = [
    # the word and a number, in parentheses or with a dash too; not after "rpc " (describe()'s
    # words for an RPC session) and not a flag or keyword ("--max-session", "max_session=").
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
    work = [w.format(s="session", S="Session", i="issue") for w in [
        "measured in {s} 17", "({s} 23)", "the {s}-19 bullet", "{S} 20's rule",
        "the {i}-17 check", "Serving ({i} 19)", "{i}s #12", "an earlier {s}'s figure",
        "in two other runs this {s}", "the table of the previous {s}", "for the next {s}",
        "found in review", "review ({s} 22)", "after the review mends",
        "unlike the Xeon of earlier\n{s}s", "an earlier\n    # {s}", "over the {s}s since",
        "in the {s} of x", "in a reviewer's test", "the {i}'s target",
        "runs of the last two {s}s", "the CPU varies from {s} to {s}"]]
    product = [w.format(s="session") for w in [
        "'rpc {s} 0 (tracker 127.0.0.1:9190)'", 'f"rpc {s} {{index}}"', "RPC {s}",
        "this RPC {s}", "a tensor of this RPC {s}", "the server's {s} process",
        "ort.InferenceSession(model)", "an onnxruntime {s}", "--max-{s} 5", "max_{s}=3.0",
        "from hgrt.rpc import {s} as {s}s", "rpc/{s}.py", "a second module in the same {s}",
        "end any {s} after this long", "in ONE {s}", "{s}s are served one at a time",
        "issues a call", r'match=r"rpc {s} \d+ \(tracker"']]
    assert [w for w in work if not hits(w)] == []
    assert [(p, hits(p)) for p in product if hits(p)] == []


def test_no_development_words():
    found = scan()
    assert not found, ("words of the development work, not of the product (say what is measured "
                       "or tested: machine, ISA, date, command; an RPC session says 'RPC "
                       "session'):\n" + "\n".join(found))
