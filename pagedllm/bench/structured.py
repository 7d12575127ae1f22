"""`pagedllm bench structured`: what structured outputs cost. A batch of requests, half of them
constrained by a JSON schema and half free, against the same batch with no constraints: the
same prompts, and each request held to the very length it had under its constraint (ignore_eos,
max_tokens = that length), so both runs have the same shape step for step and only the grammar
work differs (the bitmask of every constrained row each step, its application, the matchers'
advance). Also each schema's compile time, measured once per schema on the compile thread, and
the engine's time writing the bitmasks per step (the `grammar` part of its step timer). On a
busy machine the two rates wander with the load; the bitmask time is the direct measure."""

from __future__ import annotations

import argparse
import time

from pagedllm.bench.report import format_table, write_json
from pagedllm.entrypoints.cli_args import add_engine_args, engine_args_from

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"]},
    "order": {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}},
        "express": {"type": "boolean"}}, "required": ["items", "express"]},
    "event": {"type": "object", "properties": {"title": {"type": "string", "maxLength": 30},
                                               "day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                                               "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
              "required": ["title", "day"]},
    "point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"},
                                               "label": {"type": "string", "maxLength": 10}}, "required": ["x", "y"]},
}
TOPICS = ["a person", "a shop order", "a meeting", "a point on a map", "a book", "a city", "a recipe", "a song"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("structured", help="output tokens/s with half the batch JSON-schema constrained, vs none")
    add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--num-iters", type=int, default=2, help="alternating constrained and unconstrained runs; best of each")
    p.add_argument("--output-json", default="results/bench_structured.json")
    p.set_defaults(func=run)


def _requests(engine, num: int, output_len: int) -> list[tuple[list[int], object]]:
    """(prompt ids, params): even requests constrained (the schemas in turn), odd ones free."""
    from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

    tokenizer = engine.tokenizer
    names = list(SCHEMAS)
    requests = []
    for i in range(num):
        topic = TOPICS[i % len(TOPICS)]
        messages = [{"role": "user", "content": f"Describe {topic} as a JSON object."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        spec = StructuredOutputsParams(json=SCHEMAS[names[(i // 2) % len(names)]]) if i % 2 == 0 else None
        requests.append((prompt, SamplingParams(temperature=0, max_tokens=output_len, structured_outputs=spec)))
    return requests


def _run_batch(engine, requests, tag: str) -> tuple[float, float, list[int], list[str]]:
    """(wall seconds, this process's CPU seconds, output tokens per request, finish reasons) of
    one batch run to the end. CPU time is what other processes on a shared machine disturb
    least."""
    start, start_cpu = time.perf_counter(), time.process_time()
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{tag}-{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - start_cpu
    outs = [done[f"{tag}-{i}"] for i in range(len(requests))]
    return seconds, cpu_seconds, [len(o.token_ids) for o in outs], [o.finish_reason for o in outs]


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from pagedllm.engine.constraints import spec_key
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sampling_params import StructuredOutputsParams

    engine = LLMEngine.from_engine_args(engine_args_from(args))
    requests = _requests(engine, args.num_requests, args.output_len)
    # Compile every schema first (each once, timed on the compile thread); warm the model and the mask path.
    for _, params in requests:
        engine.check_constraints(params)
    _run_batch(engine, [(p, dataclasses.replace(q, max_tokens=4)) for p, q in requests[:4]], "warm")  # both paths
    compiled = engine.constraints.compile_seconds
    keys = {name: spec_key(StructuredOutputsParams(json=schema)) for name, schema in SCHEMAS.items()}
    compile_ms = {name: 1e3 * compiled[key] for name, key in keys.items() if key in compiled}
    rows, lengths, reasons = [], None, None
    for it in range(args.num_iters):
        before = engine.get_stats()
        seconds, cpu, lengths, reasons = _run_batch(engine, requests, f"c{it}")
        after = engine.get_stats()
        steps = after.num_steps - before.num_steps
        grammar_ms = 1e3 * (after.step_time.grammar - before.step_time.grammar) / steps
        # The same batch unconstrained, each request held to the length it had constrained.
        free = [(p, dataclasses.replace(q, structured_outputs=None, ignore_eos=True, max_tokens=n))
                for (p, q), n in zip(requests, lengths)]
        free_seconds, free_cpu, free_lengths, _ = _run_batch(engine, free, f"f{it}")
        assert free_lengths == lengths
        total = sum(lengths)
        rows.append({"iter": it, "requests": len(requests), "constrained": len(requests) // 2 + len(requests) % 2,
                     "output_tokens": total, "constrained_tok_per_s": total / seconds,
                     "unconstrained_tok_per_s": total / free_seconds, "ratio": free_seconds / seconds,
                     "cpu_ratio": free_cpu / cpu,
                     "step_ms": 1e3 * seconds / steps, "bitmask_ms_per_step": grammar_ms})
    engine.shutdown()
    best_c = max(r["constrained_tok_per_s"] for r in rows)
    best_f = max(r["unconstrained_tok_per_s"] for r in rows)
    print(format_table(rows))
    print(format_table([{"schema": name, "compile_ms": ms} for name, ms in compile_ms.items()]))
    finished = sum(1 for r in reasons[::2] if r == "stop")
    print(f"constrained requests that completed their JSON: {finished}/{len(reasons[::2])}")
    cpu_ratio = sorted(r["cpu_ratio"] for r in rows)[len(rows) // 2]
    print(f"best: constrained {best_c:.1f} tok/s, unconstrained {best_f:.1f} tok/s: "
          f"{100 * best_c / best_f:.1f}% of the unconstrained rate (target >= 90%); per CPU second "
          f"(median): {100 * cpu_ratio:.1f}%")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["compile_ms"] = compile_ms
    path = write_json(args.output_json, "structured", config, rows)
    print(f"wrote {path}")
    return 0
