"""The schema fuzzer of the reliability suite, run in a process of its own:
`python -m tests.reliability.fuzz_client URL SECONDS` fuzzes every route of the server's OpenAPI
document with schemathesis for SECONDS and prints its figures as one JSON line.

A process of its own because hypothesis's float strategies refuse to run in a process whose
floating-point unit flushes subnormal numbers to zero, which loading pagedllm's C++ kernels
turns on (they are built with -ffast-math), as every test process that built an engine has.
"""

from __future__ import annotations

import collections
import json
import math
import sys
import time
import warnings

import requests

# Checks whose failure means the server and its document disagree: a 5xx; a status, content
# type, header or body the document does not describe; a request the document forbids, served.
# Not among them: positive_data_acceptance, which fails when a request the document allows is
# refused with a (documented) 400. The document cannot state every limit: ranges such as
# presence_penalty in [-2, 2] or best_of >= n, token ids below the vocabulary size, a prompt
# that fits the context. Those refusals are counted and shown, not failed.
VIOLATION_CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
)
BATCH = 5  # examples per hypothesis run; operations take turns, a batch each
# A streamed request per route that documents server-sent events, sent before the fuzzing (a
# generated case rarely is one that streams, and each event is checked against the document).
STREAMED = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 3, "stream": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True},
    "/completion": {"prompt": "Hi", "n_predict": 3, "stream": True},
    "/completions": {"prompt": "Hi", "n_predict": 3, "stream": True},
    "/v1/messages": {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 3, "stream": True},
}


def _checks():
    from schemathesis import checks as core_checks
    from schemathesis.specs.openapi import checks as openapi_checks

    names = (*VIOLATION_CHECKS, "positive_data_acceptance")
    return [getattr(core_checks, n, None) or getattr(openapi_checks, n) for n in names]


class _Fuzzer:
    """Round-robin batches of generated cases over (operation, positive or negative data)."""

    def __init__(self, url: str) -> None:
        import schemathesis
        from schemathesis.generation.modes import GenerationMode

        self.url = url
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        self.operations = [result.ok() for result in schema.get_all_operations()]
        self.targets = [(op, mode) for op in self.operations for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
        self.strategies = {}  # built once: turning a schema into a strategy takes a while
        self.session = requests.Session()
        self.checks = _checks()
        self.cases: collections.Counter[str] = collections.Counter()  # by operation
        self.by_mode: collections.Counter[str] = collections.Counter()
        self.statuses: collections.Counter[str] = collections.Counter()  # "2xx", "4xx", ...
        self.violations: list[str] = []
        self.refused_valid = 0
        self.streamed: list[str] = []  # routes whose documented event stream was checked

    def check_streams(self) -> None:
        """Each route documenting `text/event-stream` streams a request of STREAMED, every event
        checked against the document (a route missing from STREAMED is a violation)."""
        model = self.session.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        for operation in self.operations:
            documented = operation.definition.raw.get("responses", {}).get("200", {}).get("content", {})
            if "text/event-stream" not in documented:
                continue
            if operation.path not in STREAMED:
                self.violations.append(f"{operation.label}: streams, but the fuzzer has no request that streams it")
                continue
            case = operation.Case(body={**STREAMED[operation.path], "model": model}, media_type="application/json")
            self.streamed.append(operation.label)
            self._send(operation, None, case)

    def run(self, budget_s: float) -> None:
        """A batch of every route in each mode first, however long that takes (a route never
        fuzzed proves nothing), then batches in turn until `budget_s` has passed."""
        live = [target for target in self.targets if self._batch(*target, math.inf)]
        deadline = time.monotonic() + budget_s
        while live and time.monotonic() < deadline:
            for target in list(live):
                if time.monotonic() >= deadline:
                    break
                if not self._batch(*target, deadline):
                    live.remove(target)  # every input it can generate was tried (or none exists)

    def _batch(self, operation, mode, deadline: float) -> bool:
        """One hypothesis run of up to BATCH cases; False when the operation has no more to give."""
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis.errors import Unsatisfiable

        ran = 0
        key = (operation.label, mode)
        if key not in self.strategies:
            self.strategies[key] = operation.as_strategy(generation_mode=mode)

        @settings(max_examples=BATCH, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(self.strategies[key])
        def one(case):
            nonlocal ran
            if time.monotonic() < deadline:
                ran += 1
                self._send(operation, mode, case)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                one()
            except Unsatisfiable:  # e.g. negative data for a route that takes no input
                return False
        return ran == BATCH

    def _send(self, operation, mode, case) -> None:
        from schemathesis.core.failures import Failure, FailureGroup

        response = case.call(base_url=self.url, session=self.session, timeout=60)
        self.cases[operation.label] += 1
        self.by_mode[mode.value if mode is not None else "streamed"] += 1
        self.statuses[f"{response.status_code // 100}xx"] += 1
        try:
            case.validate_response(response, checks=self.checks)
        except (FailureGroup, Failure) as exc:
            failures = exc.exceptions if isinstance(exc, FailureGroup) else [exc]
            for failure in failures:
                if type(failure).__name__ == "RejectedPositiveData":
                    self.refused_valid += 1
                else:
                    self.violations.append(f"{operation.label} [{response.status_code}] {failure.title}: "
                                           f"{case.as_curl_command()[:600]}")

    def summary(self) -> dict:
        return {
            "routes": [op.label for op in self.operations],
            "cases": dict(self.cases),
            "by_mode": dict(self.by_mode),
            "statuses": dict(self.statuses),
            "violations": self.violations,
            "refused_valid": self.refused_valid,
            "streamed": self.streamed,
        }


def main() -> None:
    url, seconds = sys.argv[1], float(sys.argv[2])
    fuzzer = _Fuzzer(url)
    begin = time.monotonic()
    fuzzer.check_streams()
    fuzzer.run(seconds)
    print(json.dumps({**fuzzer.summary(), "seconds": time.monotonic() - begin}))


if __name__ == "__main__":
    main()
