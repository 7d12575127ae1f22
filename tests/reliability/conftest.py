"""The reliability suite (docs/reliability.md): each scenario drives a real server or engine hard, prints
one line of figures, and fails on any loss. `pytest tests/reliability` runs the short form (in
`make test` too); `--soak` runs the long form (`make soak`): a 30-minute soak, ten minutes of
fuzzing, four times the clients. `--soak-seconds N` sets the soak's length in either form.

The figure lines are printed as they come (with `-s`) and again together at the end of the run.
"""

from __future__ import annotations

import pytest

from tests.reliability.common import BODY_IDLE_TIMEOUT_S, serving

_FIGURES: list[str] = []


def pytest_addoption(parser):
    group = parser.getgroup("reliability")
    group.addoption("--soak", action="store_true", help="the reliability suite's long form (make soak)")
    group.addoption("--soak-seconds", type=float, default=None, help="the soak's length (default 60, or 1800 with --soak)")


@pytest.fixture(scope="session")
def long_form(request) -> bool:
    # getoption's default: the option is unknown when this conftest loads after the command line
    # was parsed (`pytest` run from the root without naming this folder).
    return bool(request.config.getoption("--soak", default=False))


@pytest.fixture(scope="session")
def soak_seconds(request, long_form) -> float:
    seconds = request.config.getoption("--soak-seconds", default=None)
    return seconds if seconds is not None else (1800.0 if long_form else 60.0)


@pytest.fixture(scope="session")
def figures():
    """`figures(scenario, text)`: record (and print) a scenario's line of figures."""

    def record(scenario: str, text: str) -> None:
        line = f"{scenario}: {text}"
        _FIGURES.append(line)
        print("\n" + line)

    return record


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("reliability figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def served(tiny_llama):
    """`pagedllm serve` on the tiny model, in a process of its own (so its memory and threads are
    its own), shared by the scenarios that leave it as they found it."""
    with serving(tiny_llama, "--body-idle-timeout", str(BODY_IDLE_TIMEOUT_S)) as server:
        yield server
