"""llama.cpp's `llama-perplexity`, for `pagedllm bench numerics`: its KL divergence, top-1
agreement and perplexities against a base file of next-token distributions
(`pagedllm.bench.kl_divergence`: ours, or llama.cpp's own written by `write_llama_cpp_base`).
The binary is built with the peer's others (`pagedllm.bench.llama_cpp_peer.TARGETS`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from pagedllm.bench.llama_cpp_peer import LlamaCppPeerError, _tail, binary


def perplexity_command(binaries: Path, model: Path, base: Path, n_ctx: int, threads: int,
                       text: Path | None = None, chunks: int | None = None) -> list[str]:
    """`llama-perplexity` over chunks of `n_ctx` tokens: with `text`, it tokenizes the text and
    writes its own next-token distributions over the first `chunks` chunks (default: all) to
    `base`; without, it scores its distributions against those `base` holds (`--kl-divergence`,
    on the base's tokens and chunks)."""
    command = [str(binary(binaries, "llama-perplexity")), "-m", str(model), "-c", str(n_ctx), "-t", str(threads),
               "-tb", str(threads), "--kl-divergence-base", str(base)]
    if text is None:
        return command + ["--kl-divergence"]
    return command + ["-f", str(text)] + (["--chunks", str(chunks)] if chunks is not None else [])


_KLD_FIGURES = {
    "mean_kld": r"Mean\s+KLD:\s+(\S+)", "mean_kld_unc": r"Mean\s+KLD:\s+\S+\s+±\s+(\S+)",
    "kld_max": r"Maximum KLD:\s+(\S+)", "kld_p999": r"99\.9%\s+KLD:\s+(\S+)", "kld_p99": r"99\.0%\s+KLD:\s+(\S+)",
    "top1_pct": r"Same top p:\s+(\S+)", "top1_pct_unc": r"Same top p:\s+\S+\s+±\s+(\S+)",
    "ppl": r"Mean PPL\(Q\)\s+:\s+(\S+)", "ppl_base": r"Mean PPL\(base\)\s+:\s+(\S+)",
}


def parse_kl_divergence(text: str) -> dict:
    """The summary `llama-perplexity --kl-divergence` prints (mean KLD and its uncertainty, its
    99.0%, 99.9% and largest value, "Same top p" in percent and its uncertainty, both
    perplexities) and its positions (chunks times scored positions a chunk); a run that printed
    no summary raises with the output's tail."""
    chunks = re.search(r"computing over (\d+) chunks, n_ctx=(\d+)", text)
    figures = {key: re.search(pattern, text) for key, pattern in _KLD_FIGURES.items()}
    missing = [key for key, found in figures.items() if found is None]
    if chunks is None or missing:
        raise LlamaCppPeerError("llama-perplexity printed no KL-divergence summary "
                                f"(missing {', '.join(missing) or 'chunks'}):\n{_tail(text)}")
    n_chunk, n_ctx = int(chunks.group(1)), int(chunks.group(2))
    return {**{key: float(found.group(1)) for key, found in figures.items()},
            "positions": n_chunk * (n_ctx - 1 - n_ctx // 2)}


def _run_perplexity(command: list[str], log_path: Path | None) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    output = done.stdout + done.stderr
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(f"$ {' '.join(command)}\n{output}")
    if done.returncode != 0:
        raise LlamaCppPeerError(f"llama-perplexity failed (exit code {done.returncode}):\n{_tail(output)}")
    return output


def run_kl_divergence(binaries: Path, model: Path, base: Path, n_ctx: int, threads: int,
                      log_path: Path | None = None) -> dict:
    """llama.cpp's KL divergence, top-1 agreement and perplexities for `model` against the
    distributions of `base` (`parse_kl_divergence`), on the base's tokens."""
    return parse_kl_divergence(_run_perplexity(perplexity_command(binaries, model, base, n_ctx, threads), log_path))


def write_llama_cpp_base(binaries: Path, model: Path, text: Path, base: Path, n_ctx: int, threads: int,
                         chunks: int | None = None, log_path: Path | None = None) -> None:
    """llama.cpp's own next-token distributions over `text` (tokenized by llama.cpp), as a base file."""
    _run_perplexity(perplexity_command(binaries, model, base, n_ctx, threads, text=text, chunks=chunks), log_path)
    if not base.is_file():
        raise LlamaCppPeerError(f"llama-perplexity wrote no {base} (is the text at least two chunks of {n_ctx} tokens?)")
