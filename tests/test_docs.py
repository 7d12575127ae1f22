"""The README and the manual (docs/) stay true: every relative link and #anchor resolves, the
README stays a front page (at most 300 lines), every command they show parses with the real
command line (so a renamed flag breaks this test, not a reader), and their examples run as
written: the Python ones on the default model, the curl and `openai` ones against a test server
(the tiny model, served under the default model's name), with only the address swapped."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

from pagedllm.cli import build_parser, parse_command_line
from pagedllm.entrypoints.cli_args import prepare_engine_namespace
from pagedllm.config import DEFAULT_MODEL
from tests.server.common import SERVE_FLAGS, metric_samples, start_server_thread

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 300
# The address every example sends to (`make serve`'s); the tests swap in their server's.
EXAMPLE_URL = "http://127.0.0.1:8000"


@dataclass
class CodeBlock:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _code_blocks(page: Path) -> list[CodeBlock]:
    blocks, current = [], None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"^```(\w*)\s*$", line)
        if current is None and fence:
            current = CodeBlock(page, number, fence.group(1), "")
        elif current is not None and line.startswith("```"):
            blocks.append(current)
            current = None
        elif current is not None:
            current.text += line + "\n"
    assert current is None, f"{page}: a code block opened at line {current.line} is never closed"
    return blocks


def _without_code_blocks(page: Path) -> str:
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def _prose(page: Path) -> str:
    """The page without its code blocks and inline code spans (where brackets are not links)."""
    return re.sub(r"`[^`\n]*`", "", _without_code_blocks(page))


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated heading numbered."""
    anchors: set[str] = set()
    for line in _without_code_blocks(page).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            candidate, n = slug, 0
            while candidate in anchors:
                n += 1
                candidate = f"{slug}-{n}"
            anchors.add(candidate)
    return anchors


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page)) if not re.match(r"^[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in _links(page):
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists() or ROOT not in (path, *path.parents):
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
            broken.append(f"{target} (no heading #{anchor} in {path.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


def test_the_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad](#nowhere) `[code](x.md)`\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _links(page) == ["#title", "missing.md", "#nowhere"]
    with pytest.raises(AssertionError, match=r"missing.md \(no such file.*#nowhere \(no heading"):
        test_every_relative_link_and_anchor_resolves(page)


def test_the_readme_is_a_front_page_of_at_most_300_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_the_manual_index_lists_every_page():
    listed = {target.partition("#")[0] for target in _links(ROOT / "docs" / "README.md")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, f"docs/README.md does not list {sorted(pages - listed)}"


# --- commands -------------------------------------------------------------------------------

def _shell_lines(block: CodeBlock) -> list[str]:
    return block.text.replace("\\\n", " ").splitlines()


def _inline_commands(page: Path) -> list[str]:
    """Inline code spans of the prose that are whole commands: `make ...`, `bash ...`, and
    `pagedllm ...` with options (a bare `pagedllm generate` names a command); spans with
    placeholders (`<command>`, `[MODEL]`, `N`, `...`) or `--help` left out."""
    commands = []
    for span in re.findall(r"`([^`\n]+)`", _without_code_blocks(page)):
        words = _without_env(span.split())
        if len(words) < 2 or words[0] not in ("pagedllm", "make", "bash") or (words[0] == "pagedllm" and " -" not in span):
            continue
        if not any(re.match(r"^(<.*|\[.*|.*\.\.\.|.*…|[A-Z]+|--help)$", w) for w in words):
            commands.append(span)
    return commands


def _without_env(words: list[str]) -> list[str]:
    """A command's words without the environment assignments before it, `.venv/bin/pagedllm` as
    `pagedllm`."""
    while words and re.match(r"^[A-Z_]+=", words[0]):
        words = words[1:]
    return ["pagedllm", *words[1:]] if words[:1] == [".venv/bin/pagedllm"] else words


def _command_problem(line: str) -> str | None:
    """Why a shell line shown in the docs would not run as shown, or None."""
    words = _without_env(shlex.split(line, comments=True))
    if "|" in words:
        words = words[: words.index("|")]
    words = [w for w in words if w != "&"]
    if not words or words[0] in ("curl", "torchrun") and "pagedllm.cli" not in words:
        return None
    if words[0] == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        return None if set(words[1:]) <= targets else f"no Makefile target {sorted(set(words[1:]) - targets)}"
    if words[0] in ("bash", "python", ".venv/bin/python") and words[1:2] != ["-m"]:
        return None if (ROOT / words[1]).is_file() else f"no file {words[1]}"
    if words[0] != "pagedllm" and "-m" in words:  # python -m MODULE (pagedllm's -m names a model)
        module = words[words.index("-m") + 1]
        if find_spec(module) is None:
            return f"no module {module}"
        if module != "pagedllm.cli":
            return None
        words = ["pagedllm", *words[words.index("-m") + 2 :]]
    if words[0] != "pagedllm":
        return f"not a command these tests know: {words[0]}"
    try:
        args = parse_command_line(build_parser(), words[1:])
        if hasattr(args, "model_flag"):  # values refused before a model loads (--kv-cache-dtype fp8, ...)
            prepare_engine_namespace(args)
    except SystemExit:
        return "the pagedllm command line refuses it (its error is printed above)"
    except ValueError as exc:
        return f"the pagedllm command line refuses it: {exc}"
    return None


SHELL_LINES = [
    pytest.param(line, id=f"{block.name}: {line[:60]}")
    for page in PAGES for block in _code_blocks(page) if block.lang in ("bash", "sh", "")
    for line in _shell_lines(block) if line.strip() and not line.lstrip().startswith(("#", "{", '"', "}"))
    and re.match(r"^\s*([A-Z_]+=\S+\s+)*(pagedllm|\.venv/bin/pagedllm|make|bash|python|\.venv/bin/python|torchrun)\b", line)
] + [pytest.param(command, id=f"{page.relative_to(ROOT)} inline: {command[:60]}")
     for page in PAGES for command in _inline_commands(page)]


@pytest.mark.parametrize("line", SHELL_LINES)
def test_every_command_shown_parses(line):
    assert _command_problem(line) is None, f"{line!r}: {_command_problem(line)}"


def test_the_command_check_refuses_a_flag_that_does_not_exist():
    assert _command_problem("pagedllm serve --max-num-seqs 8") is None
    assert _command_problem("pagedllm serve --max-sequences 8") is not None
    assert _command_problem("make nonsense") is not None


# --- examples -------------------------------------------------------------------------------

EXAMPLES = [block for page in PAGES for block in _code_blocks(page) if block.lang in ("python", "bash")]
SERVER_EXAMPLES = [b for b in EXAMPLES if "OpenAI(" in b.text or "Anthropic(" in b.text or (b.lang == "bash" and b.text.lstrip().startswith("curl"))]
OFFLINE_EXAMPLES = [b for b in EXAMPLES if b.lang == "python" and b not in SERVER_EXAMPLES]


def test_the_readme_examples_are_all_run():
    """The README's first request (curl and openai) and its offline API example are among the
    examples run below."""
    readme = [b for b in EXAMPLES if b.page.name == "README.md" and b.page.parent == ROOT]
    assert sum(b in SERVER_EXAMPLES for b in readme) >= 2 and sum(b in OFFLINE_EXAMPLES for b in readme) >= 1
    assert all(b in SERVER_EXAMPLES or b in OFFLINE_EXAMPLES for b in readme if b.lang == "python")


@pytest.mark.parametrize("block", [b for b in EXAMPLES if b.lang == "python"], ids=lambda b: b.name)
def test_every_python_example_compiles(block):
    compile(block.text, block.name, "exec")


@pytest.fixture(scope="module")
def example_server(tiny_llama):
    """The tiny model served under the default model's name, as the examples call it."""
    args = build_parser().parse_args(["serve", str(tiny_llama), "--port", "0", *SERVE_FLAGS,
                                      "--served-model-name", DEFAULT_MODEL, "--max-model-len", "1024"])
    server, thread, url = start_server_thread(args)
    yield url
    server.should_exit = True
    thread.join(30)


def _successes(url: str) -> float:
    return sum(v for (name, _), v in metric_samples(url).items() if name == "pagedllm:request_success_total")


@pytest.mark.parametrize("block", SERVER_EXAMPLES, ids=lambda b: b.name)
def test_every_server_example_runs_against_a_server(block, example_server, capsys):
    assert EXAMPLE_URL in block.text, f"{block.name}: examples send to {EXAMPLE_URL}, as `make serve` listens"
    text = block.text.replace(EXAMPLE_URL, example_server)
    before = _successes(example_server)
    if block.lang == "python":
        exec(compile(text, block.name, "exec"), {"__name__": "__example__"})
        printed = capsys.readouterr().out
    else:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        done = subprocess.run(["bash", "-c", "set -eo pipefail\n" + text], capture_output=True, text=True, env=env,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        printed = done.stdout
        try:
            answer = json.loads(printed)
        except ValueError:  # what the example printed of the answer, not the answer itself
            answer = None
        assert not (isinstance(answer, dict) and "error" in answer), printed
    assert printed.strip(), f"{block.name} printed nothing"
    assert _successes(example_server) > before, "the example's request did not complete on the server"


@pytest.mark.slow
@pytest.mark.parametrize("block", OFFLINE_EXAMPLES, ids=lambda b: b.name)
def test_every_offline_example_runs_on_the_default_model(block, smollm_llm, monkeypatch, capsys):
    """`LLM()` in an example is the session's default-model engine (loaded once for all tests)."""
    import pagedllm

    real_llm = pagedllm.LLM
    monkeypatch.setattr(pagedllm, "LLM", lambda *args, **kwargs: smollm_llm if not args and not kwargs
                        else real_llm(*args, **kwargs))
    exec(compile(block.text, block.name, "exec"), {"__name__": "__example__"})
    assert capsys.readouterr().out.strip(), f"{block.name} printed nothing"


# Why the shell lines shown that are not run here are not (by their first words); every other
# `pagedllm` line is run as written, on the default model.
NOT_RUN = {
    "pagedllm serve": "a server runs until it is stopped: its flags parse above, and the docs' curl and openai "
    "examples run against a test server",
    "pagedllm bench": "a benchmark runs for minutes to hours: its flags parse above, and tests/test_cli.py and "
    "tests/test_bench_*.py run each benchmark on tiny models",
    "make": "set-up and the suite itself (make test runs this very test)",
    "bash": "scripts of benchmarks/ that build llama.cpp or vLLM, or need a GPU",
    "python": "a peer's server (llama.cpp), built from source",
    "torchrun": "several processes on several machines: tests/test_tensor_parallel.py runs tensor parallelism",
    "-tp": "several tensor-parallel processes: tests/test_tensor_parallel.py runs them",
}


def _why_not_run(line: str) -> str | None:
    words = _without_env(shlex.split(line, comments=True))
    for start, why in NOT_RUN.items():
        if " ".join(words).startswith(start) or start in words:
            return why
    return None


RUN_LINES = [param for param in SHELL_LINES if _why_not_run(param.values[0]) is None]


def test_every_command_shown_is_run_or_says_why_not():
    """A line of a kind the table above does not know is run: a new `pagedllm` command shown in
    the docs is tried as written unless a reason is added here."""
    run = [param.values[0] for param in RUN_LINES]
    assert all(line.split()[0] in ("pagedllm", ".venv/bin/pagedllm") for line in run), run
    assert {line.split()[1] for line in run} >= {"generate", "chat", "demo"}


@pytest.mark.slow
@pytest.mark.parametrize("line", RUN_LINES)
def test_every_command_shown_runs_as_written(line):
    """Each `pagedllm generate/chat/demo` line of the docs, run as a user would (chat answers one
    message): it exits 0 and prints an answer, and nothing but the answer on standard output."""
    words = _without_env(shlex.split(line, comments=True))
    done = subprocess.run([sys.executable, "-m", "pagedllm", *words[1:]], input="Hello\n", capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), f"{line!r} printed nothing"
    assert " INFO " not in done.stdout and "WARNING" not in done.stdout  # logs go to standard error
