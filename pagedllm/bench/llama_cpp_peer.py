"""llama.cpp as a peer of the benchmarks: the engine people run GGUF files with on a CPU.

- Built once (`ensure_llama_cpp`, `pagedllm bench llama-cpp build`) from the llama.cpp source
  that the `llama-cpp-python` sdist vendors: pip downloads the sdist into the cache, it is
  unpacked, and cmake builds `TARGETS` (`llama-server`, `llama-quantize`, `llama-bench`,
  `llama-perplexity`) for this CPU (`GGML_NATIVE`, AMX left out: it crashes), into
  `~/.cache/pagedllm/llama.cpp/<version>/build/bin` (`$PAGEDLLM_LLAMA_CPP_DIR` overrides the
  folder). Nothing of it is imported: the binaries run as processes.
- `run_llama_server` (`bench throughput --backend llama-cpp`): starts `llama-server` on the file
  with `-np` slots and continuous batching, sends every request at once to `/completion` (the
  prompt as token ids, `n_predict` tokens with `ignore_eos`: the very work the engine does), and
  counts the tokens each answer says it predicted.
- `run_single_stream` (`bench spec --llama-cpp`): `llama-server -np 1`, with or without its
  n-gram self-speculation (`ngram_simple_args`), one greedy request at a time.
- `run_llama_bench`: `llama-bench`'s prompt (pp) and generation (tg) tokens/s for a file.
- `llama-perplexity --kl-divergence` (`bench numerics`): pagedllm.bench.llama_perplexity.
- `serve`: `python -m pagedllm.bench.llama_cpp_peer --port P FILE` runs `llama-server` in
  the foreground, for `pagedllm bench serve --port P` to load-test as it does `pagedllm serve`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from pathlib import Path

from pagedllm.bench.datasets import BenchRequest
from pagedllm.paths import cache_dir
from pagedllm.utils import ExactArgumentParser

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-quantize", "llama-bench", "llama-perplexity")
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
    # Nothing is fetched while building: no HTTPS client, no web UI (prebuilt or npm), no tests.
    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
)
# Native, but without AMX: llama.cpp's AMX matrix product crashes on the first Q4_K_M prompt on
# Sapphire Rapids (ggml_backend_amx_mul_mat, llama.cpp issue #20824, measured here with 0.3.36's
# source); AVX-512 VNNI and BF16 stay. Explicit -mno-* win over -march=native in any order.
_X86_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
_STAMP = ".pagedllm-built"


class LlamaCppPeerError(RuntimeError):
    """llama.cpp could not be built or run here; the message says why and what to change."""


def default_root(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """`$PAGEDLLM_LLAMA_CPP_DIR`, else `llama.cpp/<version>` in pagedllm's cache."""
    if os.environ.get("PAGEDLLM_LLAMA_CPP_DIR"):
        return Path(os.environ["PAGEDLLM_LLAMA_CPP_DIR"])
    return cache_dir() / "llama.cpp" / version


def source_dir(root: Path, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The llama.cpp tree inside the unpacked sdist (with `convert_hf_to_gguf.py`, `gguf-py`)."""
    return root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def bin_dir(root: Path) -> Path:
    return root / "build" / "bin"


def configure_command(source: Path, build: Path, machine: str | None = None) -> list[str]:
    command = ["cmake", "-S", str(source), "-B", str(build), *CMAKE_OPTIONS]
    if (machine or platform.machine()) in ("x86_64", "AMD64"):
        command += [f"-DCMAKE_C_FLAGS={_X86_FLAGS}", f"-DCMAKE_CXX_FLAGS={_X86_FLAGS}"]
    return command


def build_command(build: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build), "--config", "Release", f"-j{jobs}", "--target", *TARGETS]


def ensure_llama_cpp(root: Path | None = None, jobs: int = 2, log=print) -> Path:
    """The folder of the built binaries, building them on first use (10-20 minutes on 2 cores)."""
    root = root or default_root()
    binaries = bin_dir(root)
    if _is_built(root):
        return binaries
    source = source_dir(root)
    if not (source / "CMakeLists.txt").is_file():
        _unpack_sdist(root, log)
    log(f"building llama.cpp ({', '.join(TARGETS)}) in {root / 'build'} (once; -j{jobs})")
    for command in (configure_command(source, root / "build"), build_command(root / "build", jobs)):
        _run_step(command, root / "build.log")
    (root / _STAMP).write_text(f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}\n")
    return binaries


def built_binaries(root: Path | None = None) -> Path:
    """The folder of an existing build's binaries; never builds (for commands that must not
    spend 10-20 minutes compiling unasked)."""
    root = root or default_root()
    if not _is_built(root):
        command = "pagedllm bench llama-cpp build" + ("" if root == default_root() else f" --dir {root}")
        raise LlamaCppPeerError(f"llama.cpp is not built in {root}: build it once with `{command}` (10-20 minutes).")
    return bin_dir(root)


def _is_built(root: Path) -> bool:
    return (root / _STAMP).is_file() and all((bin_dir(root) / t).is_file() for t in TARGETS)


def _unpack_sdist(root: Path, log) -> None:
    sdist = root.parent / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not (sdist / name).is_file():
        log(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist (llama.cpp's source) into {sdist}")
        _run_step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(sdist)], None)
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist / name) as archive:
        archive.extractall(root, filter="data")


def _run_step(command: list[str], log_path: Path | None) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise LlamaCppPeerError(f"Could not build llama.cpp: {command[0]} is not installed (it needs cmake and a C++ compiler).") from exc
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as f:
            f.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
    if done.returncode != 0:
        raise LlamaCppPeerError(f"Could not build llama.cpp ({' '.join(command[:3])} ... failed):\n{_tail(done.stderr + done.stdout)}")


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def binary(binaries: Path, name: str) -> Path:
    path = binaries / name
    if not path.is_file():
        raise LlamaCppPeerError(f"{path} is missing: build llama.cpp with `pagedllm bench llama-cpp build`.")
    return path


def gguf_file(model: str) -> Path:
    """The GGUF file llama.cpp runs for `model` (a path or the embedded default)."""
    from pagedllm.transformers_utils import resolve_model

    source = resolve_model(model)
    if source.kind != "gguf":
        raise LlamaCppPeerError(f"llama.cpp runs GGUF files; {model!r} is a {source.kind} model. Pass a .gguf file.")
    return source.path


# --- llama-server -------------------------------------------------------------------------------

def server_command(binaries: Path, model: Path, port: int, parallel: int, slot_context: int, threads: int,
                   host: str = "127.0.0.1", extra_args: Sequence[str] = ()) -> list[str]:
    """`llama-server` with `parallel` slots of `slot_context` tokens each (`-c` is their total),
    continuous batching, `threads` threads for decoding and for prompts alike."""
    return [
        str(binary(binaries, "llama-server")), "-m", str(model), "--host", host, "--port", str(port),
        "-np", str(parallel), "-c", str(parallel * slot_context), "-t", str(threads), "-tb", str(threads),
        "--cont-batching", "--no-webui", *extra_args,
    ]


def ngram_simple_args(lookup: int, draft: int) -> list[str]:
    """llama-server's n-gram self-speculation: after each token it looks for the latest earlier
    occurrence of the last `lookup` tokens in the prompt and output, and proposes the (up to)
    `draft` tokens that followed it, if at least `lookup` did. The draft's length is
    `--spec-ngram-simple-size-m` (llama.cpp's default 48; `--spec-draft-n-max` bounds only
    draft models), the lookup's `--spec-ngram-simple-size-n` (default 12)."""
    return ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(lookup),
            "--spec-ngram-simple-size-m", str(draft)]


def slot_context(requests: list[BenchRequest], max_model_len: int, multiple: int = 256) -> int:
    """Tokens per slot: the longest request (prompt and output), rounded up to `multiple`, at
    most `max_model_len`."""
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    return min(max_model_len, -(-longest // multiple) * multiple)


def completion_payload(request: BenchRequest, temperature: float, seed: int) -> dict:
    """One request for `/completion`: exactly `output_len` tokens after the prompt, sampled from
    the whole distribution as the engine's requests are (top-k, top-p and min-p off)."""
    return {
        "prompt": list(request.prompt_token_ids), "n_predict": request.output_len, "ignore_eos": True,
        "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": seed,
        "cache_prompt": False, "stream": False,
    }


def parse_completion(answer: dict, request: BenchRequest) -> int:
    """The tokens `/completion` generated; an error answer or a short one raises."""
    if "error" in answer:
        error = answer["error"]
        raise LlamaCppPeerError(f"llama-server refused a request: {error.get('message', error) if isinstance(error, dict) else error}")
    predicted = int(answer["tokens_predicted"])
    if predicted != request.output_len:
        raise LlamaCppPeerError(f"llama-server generated {predicted} tokens where {request.output_len} were asked (stop: {answer.get('stop_type')}).")
    return predicted


def greedy_payload(request: BenchRequest, cache_prompt: bool) -> dict:
    """A greedy request (temperature 0) for exactly `output_len` tokens, answered with its
    token ids, reusing the slot's cached prompt prefix when `cache_prompt` (as pagedllm's prefix
    cache does)."""
    return {**completion_payload(request, temperature=0.0, seed=0), "return_tokens": True, "cache_prompt": cache_prompt}


def parse_greedy_completion(answer: dict, request: BenchRequest) -> dict:
    """The generated token ids and, when the server speculated, its proposed and accepted
    token counts (`timings.draft_n`, `draft_n_accepted`)."""
    parse_completion(answer, request)
    timings = answer.get("timings", {})
    return {"tokens": list(answer.get("tokens", [])), "draft_tokens": int(timings.get("draft_n", 0)),
            "accepted_tokens": int(timings.get("draft_n_accepted", 0))}


def process_memory(pid: int) -> dict:
    """A process's resident memory now and at its peak, in GiB (`VmRSS`, `VmHWM`)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / (1 << 20)  # kB -> GiB
    return {"rss_gib": fields.get("VmRSS", 0.0), "peak_rss_gib": fields.get("VmHWM", 0.0)}


class LlamaServer:
    """`llama-server` as a child process for the length of a `with` block, ready when entered."""

    def __init__(self, command: list[str], port: int, log_path: Path, start_timeout_s: float = 600):
        self.command, self.port, self.log_path, self.start_timeout_s = command, port, log_path, start_timeout_s
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.__exit__(None, None, None)
                raise LlamaCppPeerError(f"llama-server exited ({self.process.returncode}) before serving:\n{_tail(self.log_path.read_text())}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__(None, None, None)
        raise LlamaCppPeerError(f"llama-server did not become ready within {self.start_timeout_s:g} s; its log: {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


async def _send_all(url: str, requests: list[BenchRequest], temperature: float, seed: int) -> int:
    import asyncio

    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def one(i: int, request: BenchRequest) -> int:
            response = await client.post(url + "/completion", json=completion_payload(request, temperature, seed + i))
            return parse_completion(response.json(), request)

        return sum(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))


def free_port() -> int:
    """A TCP port nothing listens on now, on the loopback interface."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_llama_server(
    binaries: Path, model: Path, requests: list[BenchRequest], temperature: float, seed: int, max_model_len: int,
    parallel: int = 16, threads: int | None = None, port: int | None = None, log_path: Path | None = None,
) -> dict:
    """Every request at once through `llama-server -np parallel`; the time from the first
    request to the last answer (the server's start and warm-up excluded, as vLLM's is). Each
    slot holds the longest request (llama.cpp allocates every slot's context up front)."""
    import asyncio

    threads = threads or len(os.sched_getaffinity(0))
    port = port or free_port()  # never a server already listening (another run's, a peer's)
    command = server_command(binaries, model, port, parallel, slot_context(requests, max_model_len), threads)
    log_path = log_path or default_root() / "llama-server.log"
    with LlamaServer(command, port, log_path) as server:
        start = time.perf_counter()
        num_output = asyncio.run(_send_all(server.url, requests, temperature, seed))
        elapsed = time.perf_counter() - start
        memory = process_memory(server.process.pid)
    return {"elapsed_s": elapsed, "output_tokens": num_output, "parallel": parallel, "threads": threads, **memory}


def run_single_stream(
    binaries: Path, model: Path, requests: list[BenchRequest], threads: int, max_model_len: int, num_iters: int,
    extra_args: Sequence[str] = (), cache_prompt: bool = True, warm: BenchRequest | None = None,
    port: int | None = None, log_path: Path | None = None,
) -> list[dict]:
    """Each request alone through `llama-server -np 1 [extra_args]`, greedily, `num_iters`
    times in a row; per request: the best wall time of one (`seconds`, the HTTP round trip
    included), its tokens, and the proposed and accepted tokens of all runs. `warm` runs first,
    untimed, so first-call costs stay out."""
    import httpx

    port = port or free_port()
    command = server_command(binaries, model, port, 1, slot_context(requests, max_model_len), threads, extra_args=extra_args)
    results = []
    log_path = log_path or binaries.parent.parent / "llama-server.log"  # in the build's folder
    with LlamaServer(command, port, log_path) as server, httpx.Client(timeout=None) as client:
        def one(request: BenchRequest) -> tuple[float, dict]:
            start = time.perf_counter()
            answer = client.post(server.url + "/completion", json=greedy_payload(request, cache_prompt)).json()
            return time.perf_counter() - start, parse_greedy_completion(answer, request)

        if warm is not None:
            one(warm)
        for request in requests:
            best, drafted, accepted = float("inf"), 0, 0
            for _ in range(num_iters):
                seconds, done = one(request)
                best, drafted, accepted = min(best, seconds), drafted + done["draft_tokens"], accepted + done["accepted_tokens"]
            results.append({"seconds": best, "tokens": done["tokens"], "draft_tokens": drafted, "accepted_tokens": accepted})
    return results


# --- llama-bench --------------------------------------------------------------------------------

def llama_bench_command(binaries: Path, model: Path, threads: int, n_prompt: int = 512, n_gen: int = 128,
                        repetitions: int = 3) -> list[str]:
    return [str(binary(binaries, "llama-bench")), "-m", str(model), "-t", str(threads), "-p", str(n_prompt),
            "-n", str(n_gen), "-r", str(repetitions), "-o", "json"]


def parse_llama_bench(text: str) -> list[dict]:
    """`llama-bench -o json`'s tests as rows: test (pp512, tg128), tokens/s (mean, stddev),
    threads, and the model's size and parameters as llama-bench reports them."""
    rows = []
    for test in json.loads(text):
        n_prompt, n_gen = int(test["n_prompt"]), int(test["n_gen"])
        name = f"pp{n_prompt}" if n_gen == 0 else f"tg{n_gen}" if n_prompt == 0 else f"pp{n_prompt}+tg{n_gen}"
        rows.append({
            "test": name, "tok_per_s": float(test["avg_ts"]), "stddev_tok_per_s": float(test["stddev_ts"]),
            "threads": int(test["n_threads"]), "model_type": test.get("model_type", ""),
            "model_gib": int(test.get("model_size", 0)) / (1 << 30), "model_params": int(test.get("model_n_params", 0)),
            "build_commit": test.get("build_commit", ""),
        })
    return rows


def run_llama_bench(binaries: Path, model: Path, threads: int, n_prompt: int = 512, n_gen: int = 128,
                    repetitions: int = 3) -> list[dict]:
    done = subprocess.run(llama_bench_command(binaries, model, threads, n_prompt, n_gen, repetitions),
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise LlamaCppPeerError(f"llama-bench failed (exit code {done.returncode}):\n{_tail(done.stderr)}")
    return parse_llama_bench(done.stdout)


def serve(argv: list[str] | None = None) -> None:
    """`python -m pagedllm.bench.llama_cpp_peer [--port P] [-np N] [-t T] [--ctx-size C] MODEL`:
    `llama-server` on a GGUF file in the foreground, for `pagedllm bench serve --port P`."""
    
    parser = ExactArgumentParser(prog="python -m pagedllm.bench.llama_cpp_peer", description=serve.__doc__)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--port", type=int, default=8002)
    parser.add_argument("-np", "--parallel", type=int, default=16, help="slots (requests decoded together)")
    parser.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--ctx-size", type=int, default=2048, help="tokens per slot")
    args = parser.parse_args(argv)
    command = server_command(ensure_llama_cpp(), gguf_file(args.model), args.port, args.parallel, args.ctx_size, args.threads)
    print(" ".join(command), flush=True)
    os.execv(command[0], command)


if __name__ == "__main__":
    serve()
