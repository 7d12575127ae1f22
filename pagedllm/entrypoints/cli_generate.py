"""`pagedllm generate`, `pagedllm chat` and `pagedllm demo`."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pagedllm.entrypoints.cli_args import (
    add_chat_template_arg,
    add_engine_args,
    add_sampling_args,
    engine_args_from,
    sampling_params_from,
)

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the ocean.",
    "Explain what a KV cache is in one sentence.",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one or more prompts", usage="pagedllm generate PROMPT... [--model MODEL] [options]")
    p.add_argument("prompts", nargs="+", help="prompt text (one or more)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    add_chat_template_arg(p, optional=True)
    add_engine_args(p, with_model=False, launch="cli")
    add_sampling_args(p)
    p.set_defaults(func=run_generate)

    p = sub.add_parser("chat", help="talk with the model in the terminal", usage="pagedllm chat [MODEL] [options]")
    add_engine_args(p, launch="cli")
    add_sampling_args(p, max_tokens=256)
    add_chat_template_arg(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.set_defaults(func=run_chat)

    p = sub.add_parser("demo", help="answer a few questions with the embedded model", usage="pagedllm demo [MODEL] [options]")
    add_engine_args(p, launch="cli")
    add_sampling_args(p, max_tokens=96)
    p.set_defaults(func=run_demo)


def _make_llm(args: argparse.Namespace):
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.entrypoints.openai.server_options import load_chat_template

    engine_args = engine_args_from(args)
    template = load_chat_template(getattr(args, "chat_template", None) or None)  # checked before the model loads
    kwargs = {k: v for k, v in vars(engine_args).items() if k not in ("model", "extra")}
    llm = LLM(engine_args.model, **kwargs)
    if template is not None:
        llm.get_tokenizer().chat_template = template
    return llm


def run_generate(args: argparse.Namespace) -> int:
    llm = _make_llm(args)
    params = sampling_params_from(args)
    params.n = params.best_of = args.n
    params._verify()
    if args.chat_template is not None:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outputs):
        for completion in out.outputs:
            tag = f"[{completion.index}] " if len(out.outputs) > 1 else ""
            print(f"{tag}{prompt}{completion.text}" if args.chat_template is None else f"{tag}{completion.text}")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    args.disable_log_stats = True  # no periodic stats inside the answers
    llm = _make_llm(args)
    if not getattr(llm.get_tokenizer(), "chat_template", None):  # say so before the first message
        raise ValueError(
            f"The model {args.model!r} has no chat template; give one with --chat-template (a Jinja template, a "
            "file holding one, or chatml), or use `pagedllm generate` with plain prompts."
        )
    if not args.verbose:  # from here on only warnings reach the terminal, between the answers
        logging.getLogger("pagedllm").setLevel(logging.WARNING)
    engine = llm.llm_engine
    params = sampling_params_from(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chatting with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        engine.add_request(f"chat-{turn}", llm.apply_chat_template(messages), params)
        turn += 1
        print("model> ", end="", flush=True)
        printed = 0
        reply = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                reply = out.outputs[0].text
                print(reply[printed:], end="", flush=True)
                printed = len(reply)
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0


def run_demo(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    llm = _make_llm(args)
    loaded = time.perf_counter()
    params = sampling_params_from(args)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in DEMO_QUESTIONS], params, use_tqdm=False)
    done = time.perf_counter()
    num_tokens = 0
    for question, out in zip(DEMO_QUESTIONS, outputs):
        completion = out.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"Q: {question}\nA: {completion.text.strip()}\n")
    stats = llm.llm_engine.get_stats()
    print(
        f"{len(DEMO_QUESTIONS)} requests batched together: {num_tokens} tokens in {done - loaded:.1f}s "
        f"({num_tokens / (done - loaded):.1f} tok/s); model loaded in {loaded - start:.1f}s; "
        f"KV cache of {stats.num_total_blocks} blocks x {args.block_size} tokens."
    )
    return 0
