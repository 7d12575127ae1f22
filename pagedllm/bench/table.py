"""`pagedllm bench table results/x.json`: a benchmark's report (the JSON every `pagedllm bench ...`
writes, `report.write_json`) as markdown for the manual: the date, the machine (CPU model and the
flags that pick the kernels), the command that made it, and its numbers as a table. Figures quoted
in docs/ come from result files this way, not from prose.

The command is rebuilt from the report's config (the run's parsed arguments): every option whose
value differs from its default, so it reruns the same measurement."""

from __future__ import annotations

import argparse
import json
import math
import shlex
from pathlib import Path

from pagedllm.bench.report import format_cell, machine_line

# Options that say where results go, not what was measured: left out of the command.
_NOT_MEASURED = {"help", "output_json", "output_dir"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("table", help="a benchmark's JSON report as markdown: date, machine, command, table")
    p.add_argument("reports", nargs="+", help="JSON files written by `pagedllm bench ...` (results/*.json)")
    p.add_argument("--columns", nargs="+", help="the columns to show, in this order (default: all)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print("\n\n".join(render(Path(path), args.columns) for path in args.reports))
    return 0


def render(path: Path, columns: list[str] | None = None) -> str:
    """One report as markdown: a line with its date and machine, its command, and its tables."""
    report = load_report(path)
    command = command_of(report["config"])
    lines = [
        f"{report['time'][:10]}, {machine_line(report['machine'])}.",
        f"Command: `{command}`" if command else "Command: not recorded in the report.",
    ]
    for title, rows in result_tables(report["results"]):
        lines += ["", f"{title}:", ""] if title else [""]
        lines.append(markdown_table(rows, columns))
    return "\n".join(lines)


def load_report(path: Path) -> dict:
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc}).") from None
    missing = [key for key in ("benchmark", "time", "machine", "config", "results") if key not in report]
    if missing:
        raise ValueError(f"{path}: not a report of `pagedllm bench ...` (it lacks {', '.join(missing)}).")
    return report


def command_of(config: dict) -> str | None:
    """`pagedllm bench NAME ...` with each option whose value in `config` is not its default;
    None when `config` is not a run's parsed arguments (it names no benchmark)."""
    from pagedllm.bench import BENCHMARKS, register_benchmark
    from pagedllm.entrypoints.cli_args import parse_bytes

    name = config.get("bench")
    if config.get("command") != "bench" or name not in BENCHMARKS:
        return None
    sub = argparse.ArgumentParser(prog="pagedllm bench").add_subparsers()
    register_benchmark(sub, name)
    words = ["pagedllm", "bench", name]
    # argparse keeps a parser's arguments only in `_actions`; it has no public way to list them.
    for action in sub.choices[name]._actions:
        if action.dest in _NOT_MEASURED or config.get(action.dest) is None:
            continue
        value = config[action.dest]
        if value == action.default or str(value) == str(action.default):  # serve writes inf as a string
            continue
        if not action.option_strings:
            words.append(_quote(value))
        elif isinstance(action, argparse.BooleanOptionalAction):
            flag = action.option_strings[0]
            words.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif action.nargs == 0:
            words.append(action.option_strings[0])
        else:
            show = _bytes if action.type is parse_bytes else _quote
            words += [action.option_strings[0], *(show(v) for v in (value if isinstance(value, list) else [value]))]
    return " ".join(words)


def result_tables(results) -> list[tuple[str | None, list[dict]]]:
    """(title, rows) of each table in a report's results: a list of rows is one table; a dict
    holding lists of rows (sharing's memory and prefix parts) gives one per list; any other dict
    (serve's summary) is one table of quantity and value."""
    if isinstance(results, list):
        return [(None, results)]
    parts = [(key, value) for key, value in results.items() if _is_rows(value)]
    if parts:
        return parts
    return [(None, [{"quantity": key, "value": value} for key, value in _flatten(results)])]


def markdown_table(rows: list[dict], columns: list[str] | None = None) -> str:
    columns = columns or list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return ", ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return json.dumps(value)
    return format_cell(value).replace("|", "\\|")


def _is_rows(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(row, dict) for row in value)


def _flatten(values: dict, prefix: str = ""):
    for key, value in values.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _quote(value) -> str:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return shlex.quote(str(value))


def _bytes(value: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value % size == 0:
            return f"{value // size}{unit}"
    return str(value)
