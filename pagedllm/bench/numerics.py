"""`pagedllm bench numerics [MODEL ...]`: how far int8 activations move a GGUF model's next-token
distributions from its float32-activation reference (`int8_activations="off"`), beside how far
llama.cpp's own are, on the same file, text, tokens and positions.

The text (benchmarks/data/alice-in-wonderland.txt, public domain) is tokenized once and split
into chunks of `--ctx` tokens scored as `llama-perplexity --kl-divergence` scores them
(`pagedllm.bench.kl_divergence`: the second half of each chunk, BOS first where the vocabulary
adds one). Passes, one model loaded at a time, as the engine loads it (weights packed, the
fused decoder on a CPU, `use_int8_activations` of the mode):

1. The reference, "off": each chunk in one forward pass; its distributions are written as
   llama.cpp's KL-divergence base file, and scored against that file themselves (what the base's
   16-bit rounding alone costs: the floor of every other row).
2. Each measured mode ("auto", "on"): each chunk in forward passes of `--step-tokens` tokens (64,
   a decode step's most), every weight the mode puts on int8 activations taking them at that size
   (`ChunkRunner`): the distributions a decode step computes. A mode applies them only to
   products of up to `int8_rows` rows ("on": 64; "auto": up to where a start-up trial, timed on
   this machine as it is loaded now, finds them faster), so a whole 512-token chunk would run in
   float32 and score as the reference. Scored against the base. A mode whose trial put no weight
   on int8 activations computes the reference itself, and two modes that put the same weights on
   them compute alike: such a mode's rows repeat the earlier pass's.
3. llama.cpp: `llama-perplexity --kl-divergence-base OURS --kl-divergence`, which runs the same
   tokens (it reads them from the base file and does not tokenize) with its CPU kernels, int8
   activations everywhere (Q8_0 / Q8_K), and prints the same figures.
With `--llama-cpp-logits`, llama.cpp also writes a base of its own distributions (tokenizing the
text itself); where its tokens are ours, every pagedllm pass is also scored against it.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
import tempfile
import time
from collections import Counter
from pathlib import Path

from pagedllm.bench.report import format_table, write_json

DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "alice-in-wonderland.txt"
MEASURED_MODES = ("auto", "on")  # int8_activations modes; "off" is the reference
INT8_STEP_TOKENS = 64  # quant.MAX_ROWS: the most tokens of a decode step and of the fused decoder's calls
COLUMNS = ["model", "system", "mode", "against", "mean_kld", "kld_p99", "kld_p999", "kld_max", "top1_pct", "ppl",
           "positions", "step", "int8_weights"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("numerics", help="KL divergence and top-1 agreement of int8 activations against float32's, "
                                        "beside llama.cpp's")
    p.add_argument("models", nargs="*", default=[None],
                   help="GGUF files, or gemma3-270m-q4_k_m / smollm2-135m-q4_k_m (made on first use; "
                        "pagedllm.bench.models); default: the embedded model")
    p.add_argument("--modes", nargs="+", choices=MEASURED_MODES, default=list(MEASURED_MODES),
                   help="int8_activations modes measured against the float32-activation reference (off)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity's -c)")
    p.add_argument("--chunks", type=int, default=None, help="score the first N chunks only (default: every whole chunk)")
    p.add_argument("--step-tokens", type=int, default=INT8_STEP_TOKENS,
                   help="tokens per forward pass of the int8 modes, each of their int8 weights on int8 activations "
                        "at that size")
    p.add_argument("--threads", type=int, default=2, help="torch's threads and llama.cpp's -t")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="the text (default: %(default)s)")
    p.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false", help="skip llama.cpp's figures")
    p.add_argument("--llama-cpp-logits", action="store_true",
                   help="also score every pagedllm pass against llama.cpp's own distributions")
    p.add_argument("--llama-cpp-dir", type=Path, default=None, help="the llama.cpp build (default as for bench llama-cpp)")
    p.add_argument("--base-dir", type=Path, default=None,
                   help="keep the base files here (n_vocab x 2 bytes a scored position; default: a temporary folder)")
    p.add_argument("--output-json", default="results/bench_numerics.json")
    p.set_defaults(func=run)


# --- the model, one chunk at a time -----------------------------------------------------------

class ChunkRunner:
    """A GGUF model loaded as the engine loads it, with `int8_activations=mode`, running one
    chunk at a time from position 0, `step` tokens a forward pass, through key/value pools of its
    own (one block table, `ctx` tokens), and returning the logits of the scored positions.

    Every weight the mode puts on int8 activations at some size takes them at every size up to
    `step` here: a row's int8 product does not depend on the rows beside it (per-row, per-block
    scales), so a pass of `step` tokens computes what a decode step computes for each of them, in
    far fewer passes than one token at a time."""

    def __init__(self, path: Path, ctx: int, mode: str, step: int, block_size: int = 16):
        import torch

        from pagedllm.attention import get_attention_backend
        from pagedllm.model import load_model
        from pagedllm.model.fused_layers import enable_fused_layers
        from pagedllm.model.layers import use_int8_activations
        from pagedllm.model.quant import EVERY_SIZE, method_layers
        from pagedllm.transformers_utils import resolve_model
        from pagedllm.utils import cdiv

        device = torch.device("cpu")
        self.backend = get_attention_backend("auto", device, torch.float32)
        self.model = load_model(resolve_model(str(path)), ctx, self.backend, torch.float32, device)
        self.int8_weights = use_int8_activations(self.model, mode)
        int8_layers = {name: m for name, m in method_layers(self.model).items() if m.quant_method.int8_rows > 0}
        # The weights on int8 activations in these passes: two modes that name the same compute alike.
        self.int8_names = frozenset(int8_layers)
        # Each method once: a tied LM head's is its embedding's.
        methods = list({id(m.quant_method): m.quant_method for m in int8_layers.values()}.values())
        # Which weights the mode put on int8 activations, up to how many rows ("Q4_K up to 4 rows": weights).
        self.int8_plan = dict(Counter(
            f"{'+'.join(m.qtypes)} " + ("at every size" if m.int8_rows == EVERY_SIZE else f"up to {m.int8_rows} rows")
            for m in methods
        ))
        for method in methods:  # before the fused decoder reads them
            method.int8_rows = max(method.int8_rows, step)
        enable_fused_layers(self.model, self.backend)
        self.ctx, self.step, self.block_size, self.num_blocks = ctx, step, block_size, cdiv(ctx, block_size)
        spec = self.model.kv_cache_spec()
        shapes = [self.backend.kv_cache_shape(self.num_blocks, block_size, s.num_kv_heads, s.head_dim) for s in spec]
        self.model.bind_kv_cache([torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes])

    def _metadata(self, start: int, num_tokens: int):
        """One sequence whose tokens `start` .. `start + num_tokens - 1` are computed now, its
        blocks 0, 1, ... in order (slot = position)."""
        import torch

        from pagedllm.attention import AttentionMetadata

        positions = torch.arange(start, start + num_tokens)
        metadata = AttentionMetadata(
            slot_mapping=positions.clone(), query_start_loc=torch.tensor([0, num_tokens]),
            seq_lens=torch.tensor([start + num_tokens]),
            block_tables=torch.arange(self.num_blocks, dtype=torch.int32)[None],
            query_lens=[num_tokens], seq_lens_list=[start + num_tokens], block_size=self.block_size,
            num_decodes=1 if num_tokens == 1 else 0,
        )
        return positions, metadata

    def scored_logits(self, inputs: list[int], positions: range):
        """Logits [len(positions), vocab] of `positions` of the chunk `inputs`."""
        import torch

        ids = torch.tensor(inputs)
        logits = []
        with torch.inference_mode():
            for start in range(0, min(len(inputs), positions.stop), self.step):
                end = min(start + self.step, len(inputs))
                position_ids, metadata = self._metadata(start, end - start)
                hidden = self.model(ids[start:end], position_ids, metadata)
                wanted = [p - start for p in positions if start <= p < end]
                if wanted:
                    logits.append(self.model.compute_logits(hidden[torch.tensor(wanted)]).float())
        return torch.cat(logits)


# --- the passes -------------------------------------------------------------------------------

def text_tokens(tokenizer, text: str) -> tuple[list[int], int | None]:
    """The text's tokens as llama.cpp tokenizes a file (BOS first where the vocabulary adds one,
    nothing at the end), and that BOS id (None where none is added)."""
    probe = "Hello world"
    marked, plain = tokenizer(probe)["input_ids"], tokenizer(probe, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if marked == plain:
        bos = None
    elif not (bos is not None and marked == [bos, *plain]):
        raise ValueError(f"the tokenizer adds {marked} around {plain} for {probe!r}; llama-perplexity puts "
                         "at most a BOS first and refuses vocabularies that add an EOS")
    return ([bos] if bos is not None else []) + tokenizer(text, add_special_tokens=False)["input_ids"], bos


def _model_pass(runner: ChunkRunner, tokens: list[int], bos: int | None, n_chunk: int, bases: dict, out=None,
                label: str = "") -> dict:
    """Every chunk through `runner`, scored against each base file of `bases` (name -> BaseFile);
    with `out`, the distributions are written there as base rows first (the reference pass) and
    scored against themselves under the name "self". Returns name -> PositionScores."""
    from pagedllm.bench.kl_divergence import (
        PositionScores, chunk_inputs, compress_log_probs, score_against_base, scored_positions,
    )

    ctx = runner.ctx
    positions = scored_positions(ctx)
    scores = {name: [] for name in [*bases, *(["self"] if out is not None else [])]}
    start = time.perf_counter()
    for chunk in range(n_chunk):
        logits = runner.scored_logits(chunk_inputs(tokens, ctx, chunk, bos), positions)
        targets = tokens[chunk * ctx + positions.start + 1 : chunk * ctx + positions.stop + 1]
        if out is not None:
            rows = compress_log_probs(logits)
            out.write(rows.tobytes())
            scores["self"].append(score_against_base(logits, rows, targets))
        for name, base in bases.items():
            scores[name].append(score_against_base(logits, base.chunk_rows(chunk), targets))
        if chunk == 0 or (chunk + 1) % 10 == 0 or chunk + 1 == n_chunk:
            print(f"  {label}: chunk {chunk + 1}/{n_chunk}, {time.perf_counter() - start:.0f} s", flush=True)
    return {name: PositionScores.concat(parts) for name, parts in scores.items()}


def _row(model: str, system: str, mode: str, against: str, figures: dict, **extra) -> dict:
    return {"model": model, "system": system, "mode": mode, "against": against, **figures, **extra}


def _llama_cpp_base(binaries: Path, path: Path, tokens: list[int], n_chunk: int, args, base_dir: Path, info: dict):
    """llama.cpp's own distributions over the text as a base file, or None where llama.cpp
    tokenizes the text otherwise than we do (then nothing is scored against it)."""
    import numpy as np

    from pagedllm.bench import llama_perplexity
    from pagedllm.bench.kl_divergence import read_base

    lc_path = base_dir / f"{path.stem}.llama-cpp.kld"
    start = time.perf_counter()
    llama_perplexity.write_llama_cpp_base(binaries, path, args.text, lc_path, args.ctx, args.threads, chunks=n_chunk,
                                        log_path=base_dir / f"{path.stem}.llama-cpp-base.log")
    info["seconds"]["llama.cpp base"] = time.perf_counter() - start
    lc_base = read_base(lc_path)
    same = lc_base.tokens.size == len(tokens) and bool((lc_base.tokens == np.asarray(tokens)).all())
    info["llama_cpp_tokens_match"] = same
    if not same:
        print(f"  llama.cpp tokenizes the text otherwise ({lc_base.tokens.size} tokens in its chunks, {len(tokens)} "
              "in ours): pagedllm's passes are not scored against its distributions", flush=True)
        return None
    return lc_base


def _reference_pass(path: Path, tokens: list[int], bos: int | None, n_chunk: int, n_vocab: int, ours: Path,
                    bases: dict, args, info: dict) -> dict:
    """The float32-activation pass, written to the base file `ours`; name of the base -> figures
    ("pagedllm float32": against its own rounded distributions)."""
    from pagedllm.bench.kl_divergence import summarize, write_header

    runner = ChunkRunner(path, args.ctx, "off", step=args.ctx)
    if runner.model.cfg.vocab_size != n_vocab:
        raise ValueError(f"{path.name}: the model's logits cover {runner.model.cfg.vocab_size} tokens, its vocabulary "
                         f"{n_vocab}: llama.cpp's base file needs them equal")
    start = time.perf_counter()
    with open(ours, "wb") as out:
        write_header(out, args.ctx, n_vocab, tokens)
        scores = _model_pass(runner, tokens, bos, n_chunk, bases, out, "off (reference)")
    info["seconds"]["off"] = time.perf_counter() - start
    return {"pagedllm float32": summarize(scores.pop("self")), **{k: summarize(s) for k, s in scores.items()}}


def measure_model(name: str | None, args: argparse.Namespace, binaries: Path | None,
                  base_dir: Path) -> tuple[list[dict], dict]:
    """Every row of one model (the reference's floor, each int8 mode, llama.cpp) and what was run."""
    import torch

    from pagedllm.bench import llama_perplexity
    from pagedllm.bench.kl_divergence import num_chunks, read_base, summarize
    from pagedllm.bench.models import benchmark_model
    from pagedllm.transformers_utils import get_tokenizer, resolve_model
    from pagedllm.transformers_utils.arch import gguf_metadata

    path = benchmark_model(name)
    label = path.stem
    tokens, bos = text_tokens(get_tokenizer(resolve_model(str(path))), args.text.read_text())
    n_chunk = min(num_chunks(len(tokens), args.ctx), args.chunks or math.inf)
    if n_chunk < 2:
        raise ValueError(f"{args.text} is {len(tokens)} tokens for {label}: llama-perplexity needs at least two chunks "
                         f"of --ctx {args.ctx}; give a longer --text or a smaller --ctx")
    tokens = tokens[: n_chunk * args.ctx]
    info = {"model": label, "file": str(path), "scored_tokens": len(tokens), "chunks": n_chunk, "bos": bos,
            "int8_plans": {}, "seconds": {}}
    print(f"{label}: {n_chunk} chunks of {args.ctx} tokens, {n_chunk * (args.ctx - 1 - args.ctx // 2)} scored positions",
          flush=True)
    torch.set_num_threads(args.threads)

    bases = {}
    if binaries is not None and args.llama_cpp_logits:
        lc_base = _llama_cpp_base(binaries, path, tokens, n_chunk, args, base_dir, info)
        if lc_base is not None:
            bases["llama.cpp logits"] = lc_base
    ours = base_dir / f"{label}.pagedllm-float32.kld"
    n_vocab = gguf_metadata(path)["fields"]["tokenizer.ggml.tokens"]
    reference = _reference_pass(path, tokens, bos, n_chunk, n_vocab, ours, bases, args, info)
    rows = [_row(label, "pagedllm", "off (reference)", against, figures, step=args.ctx, int8_weights=0)
            for against, figures in reference.items()]
    gc.collect()

    bases = {"pagedllm float32": read_base(ours), **bases}
    passes = {frozenset(): (reference, args.ctx, "off")}  # int8 weights -> (figures by base, step, mode)
    for mode in args.modes:
        runner = ChunkRunner(path, args.ctx, mode, step=args.step_tokens)
        info["int8_plans"][mode] = runner.int8_plan
        print(f"  {mode}: int8 activations for {runner.int8_plan or 'no weight'}", flush=True)
        if runner.int8_names in passes:  # the very computation of an earlier pass
            figures_by_base, step, same_as = passes[runner.int8_names]
            print(f"  {mode}: the same weights on int8 activations as {same_as}: its figures", flush=True)
        else:
            start = time.perf_counter()
            scores = _model_pass(runner, tokens, bos, n_chunk, bases, label=f"{mode}, {args.step_tokens} tokens a pass")
            info["seconds"][mode] = time.perf_counter() - start
            figures_by_base, step = {against: summarize(s) for against, s in scores.items()}, args.step_tokens
            passes[runner.int8_names] = (figures_by_base, step, mode)
        rows += [_row(label, "pagedllm", mode, against, figures, step=step, int8_weights=runner.int8_weights)
                 for against, figures in figures_by_base.items()]
        del runner
        gc.collect()

    if binaries is not None:
        start = time.perf_counter()
        figures = llama_perplexity.run_kl_divergence(binaries, path, ours, args.ctx, args.threads,
                                                   log_path=base_dir / f"{label}.llama-cpp-kld.log")
        info["seconds"]["llama.cpp"] = time.perf_counter() - start
        # llama.cpp's perplexity of the base is ours only if it read our distributions at our positions.
        ours_ppl = reference["pagedllm float32"]["ppl_base"]
        info["llama_cpp_read_our_base"] = math.isclose(figures["ppl_base"], ours_ppl, rel_tol=1e-3)
        if not info["llama_cpp_read_our_base"]:
            print(f"  llama.cpp's perplexity of the base, {figures['ppl_base']:.4f}, is not ours ({ours_ppl:.4f}): "
                  "it did not read our base as we wrote it", flush=True)
        rows.append(_row(label, "llama.cpp", "CPU (Q8 activations)", "pagedllm float32", figures, step=args.ctx))
    return rows, info


def _display(row: dict) -> dict:
    """A row with its figures at the precision llama.cpp prints them, means with their uncertainty."""
    shown = dict(row)
    for key in ("kld_p99", "kld_p999", "kld_max"):
        shown[key] = f"{row[key]:.6f}"
    shown["mean_kld"] = f"{row['mean_kld']:.6f} ± {row['mean_kld_unc']:.6f}"
    shown["top1_pct"] = f"{row['top1_pct']:.3f} ± {row['top1_pct_unc']:.3f}"
    shown["ppl"] = f"{row['ppl']:.4f}"
    return shown


def code_version() -> str:
    """`git describe --always --dirty` of the checkout the bench runs from ("unknown" outside one):
    the int8 kernels change, and the figures are those of this code."""
    import subprocess

    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent)
    except OSError:
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def run(args: argparse.Namespace) -> int:
    from pagedllm.bench import llama_cpp_peer
    from pagedllm.bench.models import BenchmarkModelError

    if not args.text.is_file():
        print(f"{args.text} is missing: it is in a source checkout's benchmarks/data/; pass --text FILE")
        return 1
    code = code_version()  # now: the checkout may move on during a long run
    binaries = None
    if args.llama_cpp:
        try:
            binaries = llama_cpp_peer.built_binaries(args.llama_cpp_dir)
        except llama_cpp_peer.LlamaCppPeerError as exc:
            print(f"{exc} Or pass --no-llama-cpp.")
            return 1
    rows, runs = [], []
    with tempfile.TemporaryDirectory(prefix="pagedllm-numerics-") as scratch:
        base_dir = args.base_dir or Path(scratch)
        base_dir.mkdir(parents=True, exist_ok=True)
        try:
            for model in args.models:
                model_rows, info = measure_model(model, args, binaries, base_dir)
                rows += model_rows
                runs.append(info)
                if len(args.models) > 1:
                    print(format_table([_display(r) for r in model_rows], COLUMNS), flush=True)
        except (BenchmarkModelError, llama_cpp_peer.LlamaCppPeerError, ValueError) as exc:
            print(exc)
            return 1
    print(format_table([_display(r) for r in rows], COLUMNS))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    config.update(code=code, text_sha256=hashlib.sha256(args.text.read_bytes()).hexdigest())
    print(f"wrote {write_json(args.output_json, 'numerics', config, {'rows': rows, 'runs': runs})}")
    return 0
