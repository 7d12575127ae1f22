"""The request mix of the hostile soak (test_hostile_soak.py), drawn at random from a seeded
generator: half normal clients (completions and chat, streamed and not, greedy and seeded
samples), half hostile ones (issue 51's cases and issue 36's: nested bodies, prompts past the
context, requests of many prompts, beam search with logprobs and extreme length penalties,
prompt logprobs, grammars no string satisfies, distinct heavy grammars, bad seeds, clients that
hang up, malformed JSON, wrong types, bodies over the size limit).

Each request carries the answer it must get: a normal one a 200 whose text is exactly what the
same request gave alone before the load (the server runs batch-invariant, so a request's tokens
cannot depend on its neighbours: any difference is wrong data); a hostile one its 400 naming the
field or the limit, its 413, or a 200 of the right shape. A client that hangs up expects nothing.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.entrypoints.openai.protocol import MAX_NESTING
from tests.reliability.hostage_cases import words
from tests.server.common import MAX_MODEL_LEN, MODEL

MAX_SEQS_PER_REQUEST = 256  # the server's --max-seqs-per-request
MAX_BODY_BYTES = 4 << 20  # the server's --max-body-bytes
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
PROMPTS = ["Once upon a time", "The history of the world", "Question: what is 2 + 2?", "def fibonacci(n):",
           "Dear diary, today", "The recipe calls for"]
NORMAL_MAX_TOKENS = 12
# Words of many scripts: their text has about a token per character, and two to four UTF-8 bytes
# per character (a few hundred thousand characters are far past the context, and about a MB).
NON_ASCII = ["日本語の文章", "説明", "Ölçü", "naïve", "Привет", "мир", "مرحبا", "🙂🙂", "한국어", "ελληνικά",
             "x"]


@dataclass
class Answer:
    status: int | None  # None: the client hung up before an answer came
    body: dict | None = None  # a non-streamed answer's JSON (a refusal's too)
    events: list[dict] = field(default_factory=list)  # a streamed answer's events, [DONE] left out
    done: bool = False  # the stream ended with [DONE]


@dataclass
class Request:
    kind: str
    route: str
    body: dict | bytes  # bytes: sent as they are (malformed, nested past json's encoder, UTF-8)
    status: int | tuple[int, ...] | None  # the status (or one of those) it must get; None: the client hangs up
    check: Callable[[Answer], str | None] | None = None  # what else the answer must be: a problem or None
    hang_up_after_events: int | None = None
    hang_up_after_seconds: float | None = None

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


# A heavy grammar that waits past --structured-outputs-compile-seconds for its compile (behind
# others on the compile thread, on a machine whose cores other work holds) is refused naming the
# limit: the limit doing its job, counted among the kind's 400s in the figures.
COMPILE_TIME_LIMIT = "structured_outputs_compile_seconds"


def _compile_time_limit(answer: Answer) -> str | None:
    return refused("structured_outputs.choice", (COMPILE_TIME_LIMIT,))(answer)


def refused(param: str | None = None, says: tuple[str, ...] = ()) -> Callable[[Answer], str | None]:
    """A refusal in OpenAI's shape whose `param` is `param` (if given) and whose message holds one
    of `says` (if given)."""

    def check(answer: Answer) -> str | None:
        error = (answer.body or {}).get("error") or {}
        message = error.get("message") or ""
        if not message:
            return f"no error message: {answer.body}"
        if param is not None and error.get("param") != param:
            return f"param {error.get('param')!r}, not {param!r}: {message[:200]}"
        if says and not any(s in message for s in says):
            return f"the message names none of {says}: {message[:200]}"
        return None

    return check


def choice_texts(route: str, answer: Answer) -> dict[int, str]:
    """Each choice's whole text, from a streamed answer's deltas or a non-streamed answer."""
    texts: dict[int, str] = {}
    for choice in [c for e in answer.events for c in e.get("choices", [])] or (answer.body or {}).get("choices", []):
        if route == COMPLETIONS:
            piece = choice.get("text")
        else:
            piece = (choice.get("delta") or choice.get("message") or {}).get("content")
        texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
    return texts


def _usage(answer: Answer) -> dict | None:
    usage = [e["usage"] for e in answer.events if e.get("usage")]
    return usage[-1] if usage else (answer.body or {}).get("usage")


def _well_formed(route: str, answer: Answer, choices: int, completion_tokens: int | None) -> str | None:
    """The shape every 200 must have: its choices, each with a finish reason, [DONE] at a stream's
    end, no error event, and (if given) as many completion tokens as asked."""
    if answer.events or answer.done:
        if not answer.done or any("error" in e for e in answer.events):
            return f"the stream ended without [DONE] or with an error: {answer.events[-2:]}"
        reasons = {c["index"]: c["finish_reason"] for e in answer.events for c in e.get("choices", []) if c.get("finish_reason")}
    else:
        reasons = {c["index"]: c.get("finish_reason") for c in (answer.body or {}).get("choices", [])}
    if sorted(reasons) != list(range(choices)) or not all(r in ("stop", "length") for r in reasons.values()):
        return f"{choices} choices expected, with finish reasons; got {reasons}"
    usage = _usage(answer)
    if completion_tokens is not None and (usage or {}).get("completion_tokens") != completion_tokens:
        return f"completion_tokens {(usage or {}).get('completion_tokens')}, not {completion_tokens}"
    return None


def _message(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def _deep_list(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _raw(text: str) -> bytes:
    return text.encode()


class Mix:
    """The soak's requests, drawn at random from `seed` by kind (`kinds`: name, relative weight,
    builder). `references` holds each normal request's texts, as the warm-up got them with the
    server otherwise idle."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.references: dict[tuple, dict[int, str]] = {}
        self.kinds: list[tuple[str, int, Callable[[], Request]]] = [
            ("completion", 12, lambda: self._normal(COMPLETIONS, stream=False)),
            ("completion stream", 13, lambda: self._normal(COMPLETIONS, stream=True)),
            ("chat", 12, lambda: self._normal(CHAT, stream=False)),
            ("chat stream", 13, lambda: self._normal(CHAT, stream=True)),
            ("nested body", 4, self._nested),
            ("prompt past the context", 4, self._past_context),
            ("seqs at the limit", 3, self._seqs_at_limit),
            ("seqs over the limit", 3, self._seqs_over_limit),
            ("beam + logprobs + extreme length_penalty", 5, self._beam),
            ("prompt logprobs, long prompt", 4, self._prompt_logprobs),
            ("grammar no string satisfies", 3, self._unsatisfiable),
            ("heavy grammar", 4, self._heavy_grammar),
            ("bad seed", 3, self._bad_seed),
            ("hang-up mid-stream", 4, self._hang_up_stream),
            ("hang-up before the answer", 2, self._hang_up_waiting),
            ("malformed JSON", 4, self._malformed),
            ("wrong type", 4, self._wrong_type),
            ("body over --max-body-bytes", 1, self._oversized),
            ("grammar over the cache budget", 1, self.grammar_over_budget),
        ]
        self.normal_kinds = [kind for kind, _, _ in self.kinds[:4]]

    def next(self) -> Request:
        kind = self.rng.choices(self.kinds, weights=[w for _, w, _ in self.kinds])[0]
        return kind[2]()

    def one_of_each(self) -> list[Request]:
        """A request of each kind, the grammar over the cache budget last: its refusal makes the
        server hand its freed heap back to the system."""
        return [build() for _, _, build in self.kinds if build != self.grammar_over_budget] + [self.grammar_over_budget()]

    def reference_requests(self) -> list[tuple[tuple, Request]]:
        """Every normal request there is, non-streamed, with the key of its reference."""
        return [((route, p, sampled), self._normal(route, False, p, sampled))
                for route in (COMPLETIONS, CHAT) for p in range(len(PROMPTS)) for sampled in (False, True)]

    # Normal clients: greedy, or two samples with a seed; streamed or not. Always 200, with exactly
    # the reference's texts once the warm-up has recorded them.

    def _normal(self, route: str, stream: bool, prompt: int | None = None, sampled: bool | None = None) -> Request:
        prompt = self.rng.randrange(len(PROMPTS)) if prompt is None else prompt
        sampled = self.rng.random() < 0.3 if sampled is None else sampled
        n = 2 if sampled else 1
        body = {"model": MODEL, "max_tokens": NORMAL_MAX_TOKENS, "ignore_eos": True, "stream": stream,
                **({"n": 2, "temperature": 0.8, "seed": 1000 + prompt} if sampled else {"temperature": 0})}
        body.update({"prompt": PROMPTS[prompt]} if route == COMPLETIONS else {"messages": _message(PROMPTS[prompt])})
        if stream:
            body["stream_options"] = {"include_usage": True}
        key = (route, prompt, sampled)
        kind = ("completion" if route == COMPLETIONS else "chat") + (" stream" if stream else "")

        def check(answer: Answer) -> str | None:
            problem = _well_formed(route, answer, n, n * NORMAL_MAX_TOKENS)
            if problem:
                return problem
            reference = self.references.get(key)
            texts = choice_texts(route, answer)
            if reference is not None and texts != reference:
                return f"wrong data: {key} answered {texts}, alone it was {reference}"
            return None

        return Request(kind, route, body, 200, check)

    # Hostile clients.

    def _nested(self) -> Request:
        """A body nested past the limit, in an unknown field (past the JSON parser's own ~1000
        levels too), in logit_bias, in a grammar's JSON schema or in response_format."""
        rng = self.rng
        variant = rng.randrange(4)
        if variant == 0:
            depth = rng.choice([rng.randint(MAX_NESTING + 1, 990), rng.randint(1000, 20000)])
            value = _deep_list(depth)
            fieldname = "anything"
        elif variant == 1:
            fieldname, value = "logit_bias", '{"a": ' + _deep_list(rng.randint(MAX_NESTING + 1, 900)) + "}"
        elif variant == 2:
            schema = _schema(rng.randint(MAX_NESTING // 2 + 1, 300))  # two levels a step
            fieldname, value = "structured_outputs", json.dumps({"json": schema})
        else:
            schema = _schema(rng.randint(MAX_NESTING // 2 + 1, 300))
            response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
            fieldname, value = "response_format", json.dumps(response_format)
        body = '{"model": "%s", "prompt": "Hi", "max_tokens": 2, "%s": %s}' % (MODEL, fieldname, value)

        def check(answer: Answer) -> str | None:
            error = (answer.body or {}).get("error") or {}
            message = error.get("message") or ""
            if "nests" in message or error.get("param") == fieldname or fieldname in message:
                return None
            return f"the refusal names neither {fieldname} nor the nesting: {message[:200]}"

        return Request("nested body", COMPLETIONS, _raw(body), 400, check)

    def _non_ascii(self, chars: int) -> str:
        pieces, total = [], 0
        while total < chars:
            piece = self.rng.choice(NON_ASCII) + self.rng.choice(" ,")
            pieces.append(piece)
            total += len(piece)
        return "".join(pieces)[:chars]

    def _past_context(self) -> Request:
        """100,000-300,000 characters of non-ASCII text, up to about a MB (past the characters the
        context can hold: refused untokenized), or 33,000-41,000 (within that bound: counted a
        piece at a time on the large-text thread and refused there), as a prompt or a message."""
        rng = self.rng
        chars = rng.randint(100_000, 300_000) if rng.random() < 0.5 else rng.randint(33_000, 41_000)
        text = self._non_ascii(chars)
        route = rng.choice([COMPLETIONS, CHAT])
        param = "prompt" if route == COMPLETIONS else "messages"
        body = {"model": MODEL, "max_tokens": 5, **({"prompt": text} if route == COMPLETIONS else {"messages": _message(text)})}
        # Sent as UTF-8 (json's default \u escapes would triple the bytes).
        content = json.dumps(body, ensure_ascii=False).encode()
        return Request("prompt past the context", route, content, 400, refused(param, ("context",)))

    def _seqs_at_limit(self) -> Request:
        """Exactly --max-seqs-per-request sequences: prompts x n in several shapes, served."""
        prompts, n = self.rng.choice([(16, 16), (256, 1), (32, 8), (64, 4)])
        body = {"model": MODEL, "prompt": [PROMPTS[i % len(PROMPTS)] for i in range(prompts)], "n": n, "temperature": 1.0,
                "seed": self.rng.randrange(2**32), "max_tokens": 1}
        return Request("seqs at the limit", COMPLETIONS, body, 200,
                       lambda answer: _well_formed(COMPLETIONS, answer, MAX_SEQS_PER_REQUEST, MAX_SEQS_PER_REQUEST))

    def _seqs_over_limit(self) -> Request:
        prompts, n = self.rng.choice([(17, 16), (257, 1), (300, 16), (50_000, 1)])
        body = {"model": MODEL, "prompt": ["Hi there"] * prompts, "n": n, "temperature": 1.0, "max_tokens": 1}
        return Request("seqs over the limit", COMPLETIONS, body, 400, refused("prompt", ("--max-seqs-per-request",)))

    def _beam(self) -> Request:
        """Beam search with logprobs under a length penalty from the edges of the floats; served,
        with every token's real log-probability (they were placeholders, and some penalties
        failed the step)."""
        rng = self.rng
        width = rng.randint(2, 8)
        penalty = rng.choice([1e308, -1e308, 400.0, -400.0, 1e-300, -1e-300, 0.0, 1.0])
        route = rng.choice([COMPLETIONS, CHAT])
        stream = rng.random() < 0.5
        k = rng.randint(1, 5)
        body = {"model": MODEL, "use_beam_search": True, "n": width, "best_of": width, "temperature": 0,
                "length_penalty": penalty, "max_tokens": 8, "ignore_eos": True, "stream": stream}
        if route == COMPLETIONS:
            body.update(prompt=PROMPTS[rng.randrange(len(PROMPTS))], logprobs=k)
        else:
            body.update(messages=_message(PROMPTS[rng.randrange(len(PROMPTS))]), logprobs=True, top_logprobs=k)

        def check(answer: Answer) -> str | None:
            problem = _well_formed(route, answer, width, None)
            if problem:
                return problem
            choices = [c for e in answer.events for c in e.get("choices", [])] or answer.body["choices"]
            if route == COMPLETIONS:
                values = [v for c in choices if c.get("logprobs") for v in c["logprobs"]["token_logprobs"]]
            else:
                values = [e["logprob"] for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
            if len(values) != 8 * width or not all(v is not None and math.isfinite(v) and v <= 0 for v in values):
                return f"{8 * width} real logprobs expected, got {len(values)}: {values[:8]}"
            return None

        return Request("beam + logprobs + extreme length_penalty", route, body, 200, check)

    def _prompt_logprobs(self) -> Request:
        """prompt_logprobs (or echo with logprobs) of up to 20 on a prompt that nearly fills the
        context; with stream=True a 400 naming prompt_logprobs."""
        rng = self.rng
        length = rng.randint(150, MAX_MODEL_LEN - 8)
        prompt = [rng.randrange(100, 40000) for _ in range(length)]
        k = rng.randint(1, 20)
        if rng.random() < 0.15:
            body = {"model": MODEL, "prompt": prompt, "prompt_logprobs": k, "max_tokens": 1, "stream": True}
            return Request("prompt logprobs, long prompt", COMPLETIONS, body, 400, refused("prompt_logprobs"))
        echo = rng.random() < 0.4
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1,
                **({"echo": True, "logprobs": k} if echo else {"prompt_logprobs": k})}

        def check(answer: Answer) -> str | None:
            problem = _well_formed(COMPLETIONS, answer, 1, 1)
            if problem:
                return problem
            choice = answer.body["choices"][0]
            entries = choice["logprobs"]["token_logprobs"] if echo else choice.get("prompt_logprobs")
            if entries is None or len(entries) != length + (1 if echo else 0) or entries[0] is not None:
                return f"{length} prompt logprobs expected (the first None), got {None if entries is None else len(entries)}"
            return None

        return Request("prompt logprobs, long prompt", COMPLETIONS, body, 200, check)

    def _unsatisfiable(self) -> Request:
        """A grammar no string satisfies, refused naming it: one where no token can start a
        string (`root ::= root root`, a left recursion), and one whose strings start but never
        end (`r ::= "y" r`; it was served up to max_tokens, a text of y's)."""
        rng = self.rng
        rule = f"r{rng.randrange(10**9)}"  # a spec of its own each time
        fieldname, value = rng.choice([("grammar", "root ::= root root"),
                                       ("structured_outputs", {"grammar": 'root ::= a\na ::= a "x"'}),
                                       ("grammar", f'root ::= {rule}\n{rule} ::= "y" {rule}')])
        body = {"model": MODEL, "prompt": "Say something", "max_tokens": 5, fieldname: value}

        def check(answer: Answer) -> str | None:
            error = (answer.body or {}).get("error") or {}
            if (error.get("param") or "").startswith(fieldname) and "accepts no string" in (error.get("message") or ""):
                return None
            return f"not refused naming {fieldname}: {error}"

        return Request("grammar no string satisfies", COMPLETIONS, body, 400, check)

    def _heavy_grammar(self) -> Request:
        """A choice of thousands of random strings, each request's its own (about 10 MiB compiled
        for 8,000): they fill the compiled-grammar cache, the server's main byte budget. Served, and
        the text is one of the choices (or its start, cut by max_tokens)."""
        choices = words(self.rng.randint(3000, 12000), self.rng.randrange(2**32))
        body = {"model": MODEL, "prompt": "Pick one:", "max_tokens": 16, "temperature": 0,
                "structured_outputs": {"choice": choices}}

        def check(answer: Answer) -> str | None:
            if answer.status == 400:
                return _compile_time_limit(answer)
            problem = _well_formed(COMPLETIONS, answer, 1, None)
            if problem:
                return problem
            choice = answer.body["choices"][0]
            text = choice["text"]
            ok = text in choices if choice["finish_reason"] == "stop" else any(c.startswith(text) for c in choices)
            return None if ok else f"the text {text!r} is not one of the {len(choices)} choices"

        return Request("heavy grammar", COMPLETIONS, body, (200, 400), check)

    def grammar_over_budget(self) -> Request:
        """A choice of 36,000 strings: about 90 MiB compiled, more than the whole cache budget (64
        MiB), so refused naming it once compiled (its heap handed back to the system)."""
        body = {"model": MODEL, "prompt": "Pick one:", "max_tokens": 4,
                "structured_outputs": {"choice": words(36_000, self.rng.randrange(2**32))}}
        return Request("grammar over the cache budget", COMPLETIONS, body, 400,
                       refused("structured_outputs.choice", ("structured_outputs_cache_bytes", COMPILE_TIME_LIMIT)))

    def _bad_seed(self) -> Request:
        seed = self.rng.choice([2**64, 2**64 + self.rng.randrange(10**6), -1, -self.rng.randrange(1, 2**63), 2**200])
        body = {"model": MODEL, "prompt": "Hi", "seed": seed, "temperature": 1.0, "max_tokens": 2}
        return Request("bad seed", COMPLETIONS, body, 400, refused("seed", ("[0, 2**64)",)))

    def _hang_up_stream(self) -> Request:
        request = self._normal(self.rng.choice([COMPLETIONS, CHAT]), stream=True)
        request.body["max_tokens"] = 200
        return Request("hang-up mid-stream", request.route, request.body, None,
                       hang_up_after_events=self.rng.randint(1, 5))

    def _hang_up_waiting(self) -> Request:
        request = self._normal(self.rng.choice([COMPLETIONS, CHAT]), stream=False)
        request.body["max_tokens"] = 200
        return Request("hang-up before the answer", request.route, request.body, None,
                       hang_up_after_seconds=self.rng.uniform(0.02, 0.5))

    def _malformed(self) -> Request:
        good = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        content = self.rng.choice([
            good[: self.rng.randint(1, len(good) - 1)].encode(),  # cut short
            good.replace(",", "", 1).encode(),  # a comma missing
            good.encode() + b"garbage",
            b"\xff\xfe" + good.encode(),  # not UTF-8
            b"",
            b"{" * 50_000,
            good.replace('"Hi"', "'Hi'").encode(),
        ])
        return Request("malformed JSON", COMPLETIONS, content, 400, refused())

    def _wrong_type(self) -> Request:
        fieldname, value = self.rng.choice([
            ("max_tokens", "lots"), ("temperature", "hot"), ("n", 2.5), ("prompt", 123), ("stop", {"a": 1}),
            ("seed", "x"), ("top_p", [1]), ("logit_bias", [1, 2]), ("best_of", "many"), ("logprobs", "yes"),
            ("stream", "maybe"), ("prompt", []), ("prompt", [[]]), ("max_tokens", -5), ("structured_outputs", "choice"),
        ])
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, fieldname: value}
        return Request("wrong type", COMPLETIONS, body, 400, refused(fieldname))

    def _oversized(self) -> Request:
        content = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"a" * (MAX_BODY_BYTES + 1024) + b'"}'
        return Request("body over --max-body-bytes", COMPLETIONS, content, 413, refused(None, ("--max-body-bytes",)))
