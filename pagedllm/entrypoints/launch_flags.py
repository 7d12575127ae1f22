"""Launch lines from the engines users switch from: `vllm serve`'s flags and llama-server's.

A flag of either that means something here is an alias of ours (`-c` is `--max-model-len`, `-t`
sets the threads, `-np` the batch); one that means nothing on this engine (`-O3`, `-ngl 99`,
`--mlock`) is accepted with one warning naming it; one of a feature not built here (LoRA,
reranking) is refused by name with what to use instead. docs/serving.md's table
lists them all. The parser never expands a prefix (`pagedllm.utils.ExactArgumentParser`).
"""

from __future__ import annotations

import argparse
import json
import logging
import re

from pagedllm.entrypoints.openai.reasoning import AUTO, LLAMA_REASONING_FORMATS, REASONING_PARSERS

logger = logging.getLogger("pagedllm")

# vLLM flags that change nothing here, and why (each given one warns once).
VLLM_IGNORED = {
    "--compilation-config": "the CPU step is C++ kernels with no compilation levels (-O)",
    "-O": "the CPU step is C++ kernels with no compilation levels",
    "--cuda-graph-sizes": "no CUDA graphs on a CPU (on a GPU, decode graphs are sized by --max-num-seqs)",
    "--max-seq-len-to-capture": "no CUDA graphs on a CPU",
    "--distributed-executor-backend": "tensor-parallel workers are pagedllm's own processes",
    "--max-parallel-loading-workers": "weights load in one pass",
    "--disable-frontend-multiprocessing": "the server and the engine share one process",
    "--api-server-count": "one API server process",
    "--enable-log-requests": "requests are not logged (the access log and /metrics show them)",
    "--max-log-len": "requests are not logged",
    "--hf-token": "models are never downloaded",
    "--tokenizer-revision": "models are never downloaded",
    "--code-revision": "models are never downloaded",
    "--config-format": "the config is read from the model's own files",
    "--ignore-patterns": "the weights' files are found from the folder",
    "--use-tqdm-on-load": "weights load in one pass",
    "--cpu-offload-gb": "the weights already live in CPU memory",
    "--swap-space-bytes": "give --swap-space (GiB)",
    "--disable-cascade-attn": "no cascade attention here",
    "--enable-prompt-tokens-details": "usage reports prompt tokens without details",
    "--enable-server-load-tracking": "/metrics reports the load",
    "--disable-fastapi-docs": "the docs stay at /docs; the 404 of a route that does not exist points at /openapi.json",
    "--enable-expert-parallel": "experts run on every tensor-parallel rank",
    "--async-scheduling": "the step is scheduled and computed in one thread",
    "--model-impl": "pagedllm runs its own model code",
    "--max-logprobs": "a request may ask for up to 20 logprobs per token",
    "--logprobs-mode": "logprobs are the model's own (raw) log-probabilities",
    "--response-role": "a reply's role is always assistant",
    "--guided-decoding-backend": "structured outputs always run on xgrammar",
    "--structured-outputs-config": "structured outputs always run on xgrammar",
    "--enable-sleep-mode": "the engine has no sleep mode; stop the server to free its memory",
    "--calculate-kv-scales": "the KV cache is not 8-bit, so it has no scales",
    "--prefix-caching-hash-algo": "prefix blocks are hashed by their tokens' ids",
    "--long-prefill-token-threshold": "prompt chunks are sized by the step's time budget (--max-step-seconds)",
    "--max-num-partial-prefills": "prompt chunks are sized by the step's time budget (--max-step-seconds)",
    "--max-long-partial-prefills": "prompt chunks are sized by the step's time budget (--max-step-seconds)",
    "--num-scheduler-steps": "one step is scheduled at a time",
    "--chat-template-content-format": "text parts of a message are joined for the template",
    "--exclude-tools-when-tool-choice-none": "tools are given to the template as the request sends them",
    "--enable-log-outputs": "outputs are not logged",
    "--log-config-file": "the log is Python's logging at INFO (-v: DEBUG)",
    "--h11-max-incomplete-event-size": "uvicorn's own limits apply (and --max-body-bytes)",
    "--h11-max-header-count": "uvicorn's own limits apply",
    "--enable-force-include-usage": "usage is included as the request's stream_options ask",
    "--enable-tokenizer-info-endpoint": "the tokenizer is served through /tokenize and /detokenize",
    "--enable-request-id-headers": "responses carry their request's id in the body",
    "--enable-reasoning": "reasoning is parsed whenever --reasoning-parser is given",
}
# vLLM switches (no value) among VLLM_IGNORED.
_VLLM_IGNORED_SWITCHES = (
    "--disable-frontend-multiprocessing", "--enable-log-requests", "--use-tqdm-on-load", "--disable-cascade-attn",
    "--enable-prompt-tokens-details", "--enable-server-load-tracking", "--disable-fastapi-docs",
    "--enable-expert-parallel", "--async-scheduling", "--enable-sleep-mode", "--calculate-kv-scales",
    "--exclude-tools-when-tool-choice-none", "--enable-log-outputs", "--enable-force-include-usage",
    "--enable-tokenizer-info-endpoint", "--enable-request-id-headers", "--enable-reasoning",
)
# Flags of features not built here: refused by name, with what to use instead.
REFUSED = {
    "--enable-lora": "LoRA adapters are not supported: merge the adapter into the weights (peft's merge_and_unload) "
    "and serve the merged folder",
    "--lora-modules": "LoRA adapters are not supported: merge the adapter into the weights (peft's merge_and_unload) "
    "and serve the merged folder",
    "--max-loras": "LoRA adapters are not supported",
    "--max-lora-rank": "LoRA adapters are not supported",
    "--lora": "LoRA adapters are not supported: merge the adapter into the weights and serve the result",
    "--speculative-model": "give --speculative-config '{\"method\": \"draft_model\", \"model\": PATH}' (vLLM's current flag)",
    "--limit-mm-per-prompt": "multimodal inputs are not supported: serve a text model",
    "--mm-processor-kwargs": "multimodal inputs are not supported: serve a text model",
    "--mmproj": "multimodal inputs are not supported: serve a text model",
    "--kv-transfer-config": "disaggregated prefill is not supported: one engine computes prompts and decodes",
    "--uds": "a Unix socket is not supported: give --host and --port",
    "--hf-repo": "models are never downloaded: give the path of a local GGUF file or model folder",
    "-hf": "models are never downloaded: give the path of a local GGUF file or model folder",
    "--headless": "data parallelism is not supported: run one server per machine behind a load balancer",
    "--data-parallel-rank": "data parallelism is not supported: run one server per machine behind a load balancer",
    "--data-parallel-address": "data parallelism is not supported: run one server per machine behind a load balancer",
    "--disable-sliding-window": "a model's sliding windows are part of the model: serve it as it was trained",
    "--rope-scaling": "edit rope_scaling in the model's config.json (or serve a GGUF file made with it)",
    "--rope-theta": "edit rope_theta in the model's config.json (or serve a GGUF file made with it)",
    "--hf-overrides": "edit the model's config.json",
    "--return-tokens-as-token-ids": "not supported: logprobs name tokens by their text",
    "--middleware": "not supported: put a reverse proxy in front of the server",
    "--tool-parser-plugin": "tool-call parser plugins are not supported; give a built-in --tool-call-parser",
    "--tool-server": "built-in tool servers are not supported: run the tools in your client",
    "--kv-events-config": "KV cache events are not published; /debug/kv and the dashboard show the cache",
    "--reasoning-budget": "a thinking budget is not built: cap the whole answer with max_tokens, or send "
    "chat_template_kwargs {\"enable_thinking\": false} to skip the thinking",
    "--reranking": "reranking is not built yet: serve a generation model",
    "--rope-freq-base": "edit the model's rope settings in its file",
    "--slot-save-path": "slots cannot be saved: prefix caching keeps shared prompts' KV blocks by itself",
}
# The tool-call formats parsed in "auto" mode (tool_parsers.TOOL_PARSERS' names, vLLM's).
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "llama4_json", "mistral", "pythonic", "llama4_pythonic", "qwen3_xml", "qwen3_coder",
                     "phi4_mini_json")
# llama-server flags that change nothing here (given with a value unless listed as switches).
LLAMA_IGNORED = {
    "-ngl": "the whole model runs on one device (no partial GPU offload)",
    "--n-gpu-layers": "no partial GPU offload: the whole model runs on one device",
    "--gpu-layers": "no partial GPU offload: the whole model runs on one device",
    "--mlock": "weights are read into process memory, not mapped",
    "--no-mmap": "weights are read into process memory, not mapped",
    "-fa": "attention is always the paged kernel (flash-style, one pass over the blocks)",
    "--flash-attn": "attention is always the paged kernel (flash-style, one pass over the blocks)",
    "-tb": "one thread count serves prompts and decoding: give -t",
    "--threads-batch": "one thread count serves prompts and decoding: give -t",
    "-ub": "the step's token budget is --max-num-batched-tokens (-b)",
    "--ubatch-size": "the step's token budget is --max-num-batched-tokens (-b)",
    "-cb": "batching is always continuous",
    "--cont-batching": "batching is always continuous",
    "--metrics": "/metrics is always served",
    "--slots": "/slots is always served (read-only)",
    "--no-webui": "the server has no web UI (its dashboard is at /dashboard)",
    "--cache-reuse": "prefix caching reuses whole KV blocks (--enable-prefix-caching)",
    "--no-warmup": "the engine warms up while it measures its costs",
    "--log-disable": "give --uvicorn-log-level warning to quiet the server",
    "--jinja": "chat templates are always Jinja",
    "-sm": "one device computes the model (-tp splits it across processes)",
    "--split-mode": "one device computes the model (-tp splits it across processes)",
    "-ts": "one device computes the model (-tp splits it across processes)",
    "--tensor-split": "one device computes the model (-tp splits it across processes)",
    "-mg": "one device computes the model",
    "--main-gpu": "one device computes the model",
    "--numa": "the threads are the operating system's to place",
    "-dt": "the paged KV cache never needs defragmenting",
    "--defrag-thold": "the paged KV cache never needs defragmenting",
    "-kvu": "the KV cache is always one pool shared by all requests",
    "--kv-unified": "the KV cache is always one pool shared by all requests",
    "--swa-full": "sliding-window layers keep only their window's blocks",
    "--no-context-shift": "a prompt longer than the context is refused, never shifted",
    "--context-shift": "a prompt longer than the context is refused, never shifted",
    "--props": "/props is read-only here",
    "-to": "a request runs until it finishes or its client disconnects (--body-idle-timeout bounds slow uploads)",
    "--timeout": "a request runs until it finishes or its client disconnects (--body-idle-timeout bounds slow uploads)",
    "--threads-http": "the server answers on one event loop",
    "--log-format": "the log is Python's logging",
    "--no-webui-mcp": "the server has no web UI",
}
_LLAMA_SWITCHES = ("--mlock", "--no-mmap", "-cb", "--cont-batching", "--metrics", "--slots", "--no-webui",
                   "--no-warmup", "--log-disable", "--jinja", "-kvu", "--kv-unified", "--swa-full",
                   "--no-context-shift", "--context-shift", "--props", "--no-webui-mcp")
# llama-server's KV cache types that this engine's cache holds.
LLAMA_KV_TYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}
# llama-server's `--pooling` values (the rest are refused by PoolingType.parse).
LLAMA_POOLING = ("last", "mean", "cls", "none", "rank")
# llama-server's `--chat-template` names that this server knows.
NAMED_TEMPLATES = ("chatml",)


def expand_config_file(argv: list[str]) -> list[str]:
    """vLLM's `--config FILE.yaml`: each key of the file as the flag of its name (`max-model-len:
    4k` or `max_model_len: 4k` as `--max-model-len 4k`; `true` as the bare switch, `false` as
    `--no-...`, a list as several values), placed before the other arguments so that the command
    line wins."""
    if "--config" not in argv:
        return argv
    at = argv.index("--config")
    if at + 1 >= len(argv):
        raise ValueError("--config needs a YAML file: --config FILE.yaml")
    import yaml

    path = argv[at + 1]
    try:
        with open(path) as f:
            settings = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: cannot read it as YAML ({exc})") from None
    if not isinstance(settings, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    flags: list[str] = []
    for key, value in settings.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            import json

            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    rest = argv[:at] + argv[at + 2:]
    command = next((i for i, word in enumerate(rest) if not word.startswith("-")), len(rest))
    return rest[: command + 1] + flags + rest[command + 1:]


def parse_count(text: str) -> int | None:
    """A count as vLLM reads `--max-model-len`: `4096`, `4k` (4,000), `4K` (4,096), `25.6k`,
    `1M` (2^20); `-1` or `auto` for the model's own (None)."""
    value = str(text).strip()
    if value.lower() == "auto" or value == "-1":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", value)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a count such as 4096, 4k (4,000) or 4K (4,096), got {text!r}")
    number, unit = float(match[1]), match[2]
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit]
    if not unit and "." in match[1]:
        raise argparse.ArgumentTypeError(f"expected a whole count, got {text!r}")
    return int(number * scale)


def parse_context(text: str) -> int | None:
    """llama-server's `-c`: a count, 0 for the model's own."""
    value = parse_count(text)
    return None if value == 0 else value


class _Refuse(argparse.Action):
    """A flag of a feature not built here: the command stops naming it and what to use instead."""

    def __init__(self, option_strings, dest, instead: str, **kwargs) -> None:
        self.instead = instead
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.error(f"{option_string}: {self.instead}.")


class _Ignore(argparse.Action):
    """A flag that changes nothing here: remembered, to be warned about once it parsed."""

    def __init__(self, option_strings, dest, why: str, switch: bool, **kwargs) -> None:
        self.why = why
        super().__init__(option_strings, dest, nargs=0 if switch else "?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        given = option_string + ("" if values in (None, []) else f" {values}")
        ignored = getattr(namespace, "ignored_flags", None) or []
        namespace.ignored_flags = ignored + [(given, self.why)]


def add_launch_flags(parser: argparse.ArgumentParser, serve: bool) -> None:
    """vLLM's and llama-server's flags beside ours on `parser` (serve's, chat's, generate's).
    The engine arguments themselves carry the aliases that mean the same (`-c`, `-t`, `-np`...)."""
    parser.set_defaults(ignored_flags=[])
    group = parser.add_argument_group("accepted from vLLM and llama-server (they change nothing here)")
    for flag, why in {**VLLM_IGNORED, **LLAMA_IGNORED}.items():
        switch = flag in _VLLM_IGNORED_SWITCHES or flag in _LLAMA_SWITCHES
        group.add_argument(flag, action=_Ignore, why=why, switch=switch, dest="ignored_" + flag.strip("-"), help=why)
    refused = parser.add_argument_group("refused: features not built here")
    for flag, instead in REFUSED.items():
        refused.add_argument(flag, action=_Refuse, instead=instead, dest="refused_" + flag.strip("-"), help=instead)
    others = parser.add_argument_group("vLLM's choices of what to run")
    # Embeddings (/v1/embeddings, /pooling) are served whatever these say; generation stays too.
    others.add_argument("--task", default=None, help="generate or embed: both are always served")
    others.add_argument("--runner", default=None, help="generate, pooling or auto: generation and pooling are "
                        "always both served")
    others.add_argument("--convert", default=None, help="vLLM's: embed, none or auto (embeddings are always served)")
    others.add_argument("--embedding", "--embeddings", dest="embedding", action="store_true", default=False,
                        help="llama-server's: serve embeddings (always served here; generation stays available)")
    others.add_argument("--pooling", "--pooling-type", dest="pooling", default=None, choices=LLAMA_POOLING,
                        metavar="{last,mean,cls}", help="the pooling of embeddings that do not say (default last); "
                        "the same as --pooler-config '{\"pooling_type\": ...}'")
    others.add_argument("--quantization", "-q", default=None, help="read from the weights' files; gguf or none")
    others.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="1: one engine per server")
    others.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="1 (give --tensor-parallel-size)")
    others.add_argument("-ctk", "--cache-type-k", default=None, help="llama-server's KV type: f32, f16 or bf16")
    others.add_argument("-ctv", "--cache-type-v", default=None, help="llama-server's KV type: f32, f16 or bf16")
    others.add_argument("--scheduling-policy", default=None, help="fcfs (first come, first served; priority is not built)")
    others.add_argument("-md", "--model-draft", default=None, help="llama-server's draft model: speculative decoding")
    others.add_argument("--draft-max", "--draft", "--draft-n", dest="draft_max", type=int, default=None,
                        help="llama-server's tokens proposed per step by the draft model (default 16)")
    others.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    if serve:
        others.add_argument("--enable-auto-tool-choice", action="store_true",
                            help="parse the tool calls a model makes on its own (always on with tools)")
        others.add_argument("--tool-call-parser", default=None, help=f"the calls' format: {', '.join(TOOL_CALL_PARSERS)}")
        others.add_argument("--reasoning-parser", default=None, metavar="NAME",
                            help="split a thinking model's reasoning from its answer (message.reasoning): "
                            + ", ".join(REASONING_PARSERS))
        others.add_argument("--reasoning-format", default=None, metavar="FORMAT",
                            help="llama-server's: none, or auto / deepseek (the parser the chat template calls for)")


def apply_launch_flags(ns: argparse.Namespace) -> None:
    """Check the values of vLLM's and llama-server's flags and fold them into ours; a
    ValueError names a value this engine does not serve. Warns once for each ignored flag."""
    for given, why in getattr(ns, "ignored_flags", None) or []:
        logger.warning("Ignoring %s: %s.", given, why)
    _apply_pooling_flags(ns)
    quantization = getattr(ns, "quantization", None)
    if quantization not in (None, "gguf", "none"):
        raise ValueError(
            f"--quantization {quantization} is not supported here: the weights' quantization is read from their "
            "files (GGUF types as stored, or an unquantized folder). Drop --quantization."
        )
    if getattr(ns, "data_parallel_size", 1) != 1:
        raise ValueError(
            "--data-parallel-size is not supported here: one engine serves each server. Run one server per "
            "machine (or per group of cores) behind a load balancer, or give --tensor-parallel-size."
        )
    if getattr(ns, "pipeline_parallel_size", 1) != 1:
        raise ValueError("--pipeline-parallel-size is not supported here: give --tensor-parallel-size instead.")
    _apply_kv_types(ns)
    if getattr(ns, "scheduling_policy", None) not in (None, "fcfs"):
        raise ValueError(
            f"--scheduling-policy {ns.scheduling_policy} is not built yet: requests are served first come, first "
            "served. Drop --scheduling-policy (or give fcfs)."
        )
    if getattr(ns, "model_draft", None) is not None:
        if getattr(ns, "speculative_config", None) is not None:
            raise ValueError("Give -md or --speculative-config, not both: they set the same draft model.")
        ns.speculative_config = {"method": "draft_model", "model": ns.model_draft,
                                 "num_speculative_tokens": ns.draft_max or 16}
    _apply_reasoning_flags(ns)
    parser = getattr(ns, "tool_call_parser", None)
    if parser is not None and parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"--tool-call-parser {parser} is not built yet: give one of {', '.join(TOOL_CALL_PARSERS)} (the "
            "format the model writes its calls in), or send tool_choice 'required' or a named function, which "
            "constrain the output to a valid call in any model."
        )


def _apply_pooling_flags(ns: argparse.Namespace) -> None:
    """vLLM's `--task embed`, `--runner pooling`, `--convert embed` and llama-server's
    `--embedding` are accepted (embeddings are always served, and generation stays available);
    llama-server's `--pooling` sets `pooler_config`'s pooling type."""
    from pagedllm.pooling_params import PoolerConfig, PoolingType, pooling_asked

    asked = [pooling_asked(flag, getattr(ns, flag, None)) for flag in ("task", "runner", "convert")]
    if any(asked) or getattr(ns, "embedding", False):
        logger.info("Embeddings are always served (/v1/embeddings, /pooling, LLM.embed); generation stays available.")
    given = getattr(ns, "pooler_config", None)
    config = PoolerConfig.parse(given)  # a bad --pooler-config fails here, before the model loads
    pooling = getattr(ns, "pooling", None)
    if pooling is None:
        return
    kind = PoolingType.parse(pooling, "--pooling")
    if given is not None and "pooling_type" in str(given) and config.pooling_type is not kind:
        raise ValueError(f"--pooling {pooling} and --pooler-config's pooling_type differ; give one of them.")
    ns.pooler_config = json.dumps({"pooling_type": kind.name, "normalize": config.normalize})


def _apply_reasoning_flags(ns: argparse.Namespace) -> None:
    """`--reasoning-parser NAME` checked, and llama-server's `--reasoning-format` folded into it
    (none: no parser; auto / deepseek: the parser the chat template calls for, `AUTO`)."""
    name, llama_format = getattr(ns, "reasoning_parser", None), getattr(ns, "reasoning_format", None)
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {name} is not a reasoning parser here; give one of {', '.join(REASONING_PARSERS)} "
            "(deepseek_r1 when the template opens <think> in the prompt, qwen3 when the model opens it)."
        )
    if llama_format is None:
        return
    if llama_format not in LLAMA_REASONING_FORMATS:
        raise ValueError(
            f"--reasoning-format {llama_format} is not served here; give one of {', '.join(LLAMA_REASONING_FORMATS)} "
            "(deepseek-legacy's tags left in the content are not built)."
        )
    if name is not None:
        raise ValueError("Give --reasoning-parser or --reasoning-format, not both: they choose the same parser.")
    ns.reasoning_parser = None if llama_format == "none" else AUTO


def _apply_kv_types(ns: argparse.Namespace) -> None:
    """llama-server's `-ctk`/`-ctv` as the KV cache's dtype (keys and values alike here)."""
    given = {flag: getattr(ns, dest, None) for flag, dest in (("-ctk", "cache_type_k"), ("-ctv", "cache_type_v"))}
    given = {flag: value for flag, value in given.items() if value is not None}
    for flag, value in given.items():
        if value not in LLAMA_KV_TYPES:
            raise ValueError(
                f"{flag} {value} is not supported here: the KV cache holds {', '.join(LLAMA_KV_TYPES)} "
                "(a quantized KV cache is not built yet). Give f16 or bf16 to halve a float32 cache."
            )
    if len(set(given.values())) > 1:
        raise ValueError("-ctk and -ctv differ: keys and values share one dtype here; give the same type to both.")
    if given:
        ns.kv_cache_dtype = LLAMA_KV_TYPES[next(iter(given.values()))]
