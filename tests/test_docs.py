"""The documents a user reads: a short README, one page per topic under docs/, figures that
BENCHMARKS.md backs, links that resolve, and the two set-up commands that `.ci/run` runs.

A figure is a number with a unit of time, memory, a ratio or a share (``2.13 ms``, ``4 MiB``,
``0.88x``, ``0-3 %``); each one in README.md or docs/*.md must appear in BENCHMARKS.md, where
its machine and command are named. Inline code (``x86-64``, ``4 << 30``, ``sm_80``) is not
prose and is not scanned; fenced blocks are (a quoted output with timings is a figure too).
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
BENCHMARKS = os.path.join(ROOT, "BENCHMARKS.md")
CI = os.path.join(ROOT, ".ci", "run")
MAX_README_LINES = 150

MAIN_JOB = ('python3 -m venv .venv && .venv/bin/pip install -e ".[bench]" && '
            '.venv/bin/python python/main_job.py')
TESTS = ('python3 -m venv .venv && .venv/bin/pip install -e ".[test,onednn,cuda,bench]" && '
         '.venv/bin/python -m pytest')

_NUM = r"\d+(?:\.\d+)?"
# a number (or a range of two) and a unit; not inside a word ("sm_80", "x86-64", "v2"), not a
# dimension ("4x4", "3x3"), not hex ("0x4C"): "x" must end the token
FIGURE = re.compile(
    rf"(?<![\w.\-/:])({_NUM}(?:\s?[-–]\s?{_NUM})?)"
    r"(\s?(?:ms|us|µs|μs|MiB|GiB|KiB|MB|GB|KB|%)(?![\w])|[x×](?![\w]))")
INLINE_CODE = re.compile(r"`[^`\n]*`")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<img\s[^>]*src=\"([^\"]+)\"")


def documents() -> list[str]:
    return [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def normal(figure: str) -> str:
    """One spelling per figure: no spaces, "-" for a range, "x" for a ratio."""
    return re.sub(r"\s", "", figure).replace("–", "-").replace("×", "x")


def figures(text: str) -> list[tuple[int, str]]:
    """(line number, figure) of every figure outside inline code."""
    found = []
    for n, line in enumerate(text.split("\n"), 1):
        prose = INLINE_CODE.sub(" ", line)
        found += [(n, m.group(0)) for m in FIGURE.finditer(prose)]
    return found


def backed_by(figure: str, source: str) -> bool:
    """``figure`` occurs in ``source``, up to spacing and typography."""
    want = normal(figure)
    return any(normal(m.group(0)).endswith(want) and
               (normal(m.group(0)) == want or normal(m.group(0))[-len(want) - 1] in "-")
               for m in FIGURE.finditer(source))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: str) -> set[str]:
    text = FENCE.sub("", read(path))
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.MULTILINE)}


def broken_links(path: str) -> list[str]:
    text = FENCE.sub("", read(path))
    bad = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.isfile(dest):
            bad.append(f"{target}: no file {os.path.relpath(dest, ROOT)}")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    return bad


def ci_command() -> str:
    lines = [ln.strip() for ln in read(CI).splitlines()]
    runs = [ln for ln in lines if ln and not ln.startswith("#") and "pytest" in ln]
    assert len(runs) == 1, f".ci/run should run one pytest command, found {runs}"
    return runs[0]


def test_the_figure_pattern():
    text = ("run() 2.13 ms, 4 MiB of scratch, 0.88x, 1.24×, 0-3 % and 90–99 % of it, "
            "5.82 MB; not x86-64, sm_80, cpu:0, port 9190, F(4x4, 3x3), 0x4C4E, Python 3.11, "
            "`4.5 ms in code`, 10.0.0.0/24, 2 x 20 calls")
    assert [f for _, f in figures(text)] == ["2.13 ms", "4 MiB", "0.88x", "1.24×", "0-3 %",
                                             "90–99 %", "5.82 MB"]
    source = "took 0.34–0.57× the time, 2.13 ms, 1 x 2, 4 MiB of scratch, 12.13 ms"
    assert backed_by("0.57x", source) and backed_by("0.34-0.57×", source)
    assert backed_by("2.13ms", source) and backed_by("4 MiB", source)
    assert not backed_by("13 ms", source) and not backed_by("4 MB", source)
    assert not backed_by("0.34x", source)


def test_readme_is_short():
    n = len(read(README).splitlines())
    assert n <= MAX_README_LINES, (f"README.md has {n} lines (at most {MAX_README_LINES}): move "
                                   f"the detail to a page under docs/")


def test_readme_has_the_two_commands_and_ci_runs_the_test_command():
    lines = [ln.strip() for ln in read(README).splitlines()]
    assert MAIN_JOB in lines, f"README.md lacks the main job's command, word for word:\n{MAIN_JOB}"
    assert TESTS in lines, f"README.md lacks the test command, word for word:\n{TESTS}"
    assert ci_command() == TESTS, ".ci/run runs another test command than README.md's"


def test_every_figure_is_in_benchmarks():
    source = read(BENCHMARKS)
    missing = [f"{os.path.relpath(path, ROOT)}:{n}: {fig}"
               for path in documents() for n, fig in figures(read(path))
               if not backed_by(fig, source)]
    assert not missing, ("figures that BENCHMARKS.md does not hold (quote it verbatim with its "
                         "machine, or link to it):\n" + "\n".join(missing))


def test_every_relative_link_resolves():
    bad = [f"{os.path.relpath(path, ROOT)}: {b}" for path in documents()
           for b in broken_links(path)]
    assert not bad, "links to nothing:\n" + "\n".join(bad)


def test_the_docs_pages_exist():
    pages = {os.path.basename(p) for p in documents()[1:]}
    assert {"architecture.md", "boards.md", "cli.md", "kernels.md", "placement.md",
            "remote.md", "testing.md"} <= pages
