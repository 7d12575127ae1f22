"""The weight cache: a GGUF model's weights in the form the model computes with, written the
first time the file is loaded and memory-mapped on every later start.

Loading a GGUF file means packing the quantized blocks into the layout the kernels read (or,
where they do not apply, dequantizing and converting to the model's dtype): seconds of work whose
result depends only on the file's bytes and a few settings. The first load saves that result
under `cache_dir()/weights/<key>/`; later loads map it (safetensors maps files copy-on-write), so
start-up pages weights in instead of computing them, and servers of the same model share the
pages. The key hashes the file's bytes, the dtype, the device type, the tensor-parallel rank and
size, the `gguf` version that dequantized them, and the code that loads and lays them out.
oneDNN's packed layout is opaque and rebuilt at each start (a fraction of a second); the float
pages it was packed from are then handed back to the file (`release_unread_pages`), so each
weight stays in memory once per form a kernel reads. (A Hugging Face folder is not cached: its
safetensors files are mapped already, and nothing is derived from them but fused projections.)

An entry is a folder with `weights.safetensors` (each parameter under its name: a GGUF-packed
weight as the flat bytes its kernel reads, about the file's size; float and 16-bit weights as they
are) and `manifest.json` (the file's size and CRC-32, and what it was built from); the
safetensors metadata holds each packed weight's method (`LinearMethod.cache_description`), and
each packed mixture of experts' (`ExpertsMethod.cache_description`, by module name). It is
published whole by a rename; on load a wrong size, checksum, name, shape or dtype means the entry
is discarded and rebuilt, never used. When a new entry is written, entries unused for
`UNUSED_ENTRY_DAYS` are removed, and so are those of the same file and settings built by other
code (an upgrade of pagedllm makes them unreachable) once unused for `SUPERSEDED_ENTRY_HOURS`
(two versions started side by side keep theirs). `PAGEDLLM_MODEL_CACHE=0` turns the cache off;
deleting the folder clears it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import sys
import threading
import time
import zlib
from pathlib import Path

import torch
from torch import nn

from pagedllm.distributed import TensorParallelGroup
from pagedllm.kernels import gguf as gguf_kernels
from pagedllm.model import quant
from pagedllm.model.quant import experts as quant_experts
from pagedllm.paths import cache_dir
from pagedllm.transformers_utils.file_cache import (
    discard_entry,
    entry_key,
    file_digest,
    read_json,
    staged_entry,
)
from pagedllm.transformers_utils.source import ModelSource

logger = logging.getLogger("pagedllm")

# The layout of an entry. What goes into it is also keyed by the code that computes it
# (`_code_digest`), so a change to loading or to a weight form never meets an old entry.
WEIGHT_FORMAT_VERSION = 2

WEIGHTS_FILE = "weights.safetensors"
MANIFEST_FILE = "manifest.json"
_CRC_CHUNK = 1 << 24
# Never fill a disk to its last GiB with a cache.
_FREE_DISK_MARGIN = 1 << 30
# An entry no start has used for this long is removed when another is written.
UNUSED_ENTRY_DAYS = 30
# An entry of the same file and settings built by other code, unused for this long, likewise.
SUPERSEDED_ENTRY_HOURS = 1


@functools.cache
def _code_digest() -> str:
    """A hash of the code that decides what is saved (reading, dequantizing, fusing, unpacking):
    an entry written by other code is a different entry, never a stale one."""
    import pagedllm.transformers_utils.families
    import pagedllm.transformers_utils.gguf_config

    # Every model family's code (which parameters exist, how GGUF tensors map onto them), the
    # packed layout (the kernels' packing), and how a GGUF file's metadata becomes the architecture.
    # (model/quant/ included: the weight forms and their packing live there)
    files = sorted(Path(__file__).parent.rglob("*.py"))
    files.append(Path(gguf_kernels.__file__))
    files.append(Path(pagedllm.transformers_utils.gguf_config.__file__))
    files.append(Path(pagedllm.transformers_utils.families.__file__))  # each family's GGUF tensor names
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def weights_root() -> Path:
    return cache_dir() / "weights"


def lineage(source: ModelSource, dtype: torch.dtype, device: torch.device, tp: TensorParallelGroup) -> str:
    """What an entry is of, whatever code built it: the file's bytes and this rank's settings.
    Entries of one lineage but other code are superseded (see `save`)."""
    return entry_key(file_digest(source.path), dtype, device.type, f"tp={tp.rank}/{tp.size}")


def entry_path(source: ModelSource, dtype: torch.dtype, device: torch.device, tp: TensorParallelGroup) -> Path:
    """The cache folder for the weights of the GGUF file `source` as this rank loads them."""
    from importlib.metadata import version

    parts = [
        f"format={WEIGHT_FORMAT_VERSION}",
        f"code={_code_digest()}",
        lineage(source, dtype, device, tp),
        f"gguf={version('gguf')}",
    ]
    return weights_root() / f"{source.name}-{entry_key(*parts)}"


def _file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)  # releases the GIL
    return crc


# --- saving ----------------------------------------------------------------------------------

def _method_params(model: nn.Module) -> dict[str, nn.Module]:
    """The parameter name of each weight owned through a method -> its layer (a tied head,
    whose table is the embedding's, not again)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return {names[id(m.weight)]: m for m in quant.method_layers(model).values()
            if "tied_embedding" not in m.__dict__}


def _packed_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Each mixture's experts whose method is not float (`moe.Experts`), by module name."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "experts_method", None), quant_experts.ExpertsMethod)
            and m.experts_method.cache_description is not None}


def _saved_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict[str, dict]]:
    """Every parameter (tied ones once) in the form its kernel reads, on the CPU, the methods
    of the packed and 16-bit ones, and those of packed experts (by module name)."""
    tensors = {name: param.detach().cpu().contiguous() for name, param in model.named_parameters()}
    methods = {name: m.quant_method.cache_description for name, m in _method_params(model).items()
               if m.quant_method.cache_description is not None}
    experts = {name: m.experts_method.cache_description for name, m in _packed_experts(model).items()}
    return tensors, methods, experts


def save(model: nn.Module, entry: Path, describe: dict) -> None:
    """Write `model`'s weight forms as the cache entry `entry` (atomically; if another process
    wrote it first, theirs is kept). `describe` goes into the manifest; its "lineage" (`lineage`)
    lets this write remove the entries it supersedes."""
    from safetensors.torch import save_file

    tensors, methods, experts = _saved_tensors(model)
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    entry.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(entry.parent).free
    if needed > free - _FREE_DISK_MARGIN:
        raise OSError(f"{needed / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free")
    _sweep(entry.parent, entry, describe.get("lineage"))
    with staged_entry(entry) as staging:
        path = staging / WEIGHTS_FILE
        save_file(tensors, str(path), metadata={"methods": json.dumps(methods), "experts": json.dumps(experts)})
        manifest = {
            "format": WEIGHT_FORMAT_VERSION,
            **describe,
            "size": path.stat().st_size,
            "crc32": _file_crc32(path),
        }
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))


def _sweep(root: Path, writing: Path, lineage: str | None) -> None:
    """Discard entries no start has used for `UNUSED_ENTRY_DAYS` (each load marks its entry):
    those of files or settings long gone; and the entries `writing` supersedes, of `lineage`
    but other code, unused for `SUPERSEDED_ENTRY_HOURS`."""
    now = time.time()
    for entry in root.iterdir():
        if entry.name.startswith(".") or entry.name == writing.name:
            continue
        try:
            unused = now - (entry / MANIFEST_FILE).stat().st_mtime
            superseded = lineage is not None and unused > SUPERSEDED_ENTRY_HOURS * 3600 \
                and (read_json(entry / MANIFEST_FILE) or {}).get("lineage") == lineage
            if unused > UNUSED_ENTRY_DAYS * 86400 or superseded:
                discard_entry(entry)
        except OSError:
            pass


# --- loading ---------------------------------------------------------------------------------

class CacheEntryError(ValueError):
    """A cache entry that cannot be used as it is (then it is discarded and rebuilt)."""


class Checksum:
    """The CRC-32 of an entry's weights file, computed in a thread while start-up goes on
    (zlib releases the GIL): the weights are packed meanwhile, and used only once it passed."""

    def __init__(self, entry: Path, expected: object) -> None:
        self.entry = entry
        self._expected = expected
        self._actual: int | None = None
        self._thread = threading.Thread(target=self._run, name="pagedllm-weights-checksum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._actual = _file_crc32(self.entry / WEIGHTS_FILE)
        except OSError:
            pass

    def passed(self) -> bool:
        """Wait for the checksum; False (the entry discarded, with a warning) if it differs."""
        self._thread.join()
        if self._actual != self._expected:
            logger.warning(
                "Discarding the cached weights at %s (its file fails its checksum); rebuilding them", self.entry
            )
            discard_entry(self.entry)
            return False
        return True


def _read_entry(entry: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict], dict[str, dict], Checksum]:
    """The entry's tensors, memory-mapped, once its files match the manifest's description; the
    checksum of their bytes is still running."""
    from safetensors import safe_open

    manifest = read_json(entry / MANIFEST_FILE)
    if manifest is None or manifest.get("format") != WEIGHT_FORMAT_VERSION:
        raise CacheEntryError("no valid manifest")
    path = entry / WEIGHTS_FILE
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CacheEntryError(f"weights file unreadable ({exc})") from exc
    if size != manifest.get("size"):
        raise CacheEntryError(f"weights file has {size} bytes, the manifest says {manifest.get('size')}")
    checksum = Checksum(entry, manifest.get("crc32"))
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            methods = json.loads(metadata.get("methods", "{}"))
            experts = json.loads(metadata.get("experts", "{}"))
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # safetensors raises its own error types
        raise CacheEntryError(f"weights file unreadable ({exc})") from exc
    return tensors, methods, experts, checksum


def _expected_form(layer: nn.Module, description: dict, saved: torch.Tensor) -> bool:
    """Whether a saved packed or 16-bit weight fits the layer's (float placeholder) weight."""
    rows, cols = quant.logical_shape(layer)  # (a placeholder's, or those of the method loading installed)
    if description.get("method") == "half":
        return saved.dtype in (torch.float16, torch.bfloat16) and tuple(saved.shape) == (rows, cols)
    parts = description.get("parts", [])
    return (description.get("method") == "gguf" and saved.dtype == torch.uint8 and saved.dim() == 1
            and saved.numel() == sum(p["nbytes"] for p in parts) and sum(p["out_features"] for p in parts) <= rows
            and all(p["in_features"] == cols for p in parts))


def _expert_bytes(module: nn.Module, description: dict) -> dict[str, int]:
    """The bytes of each flat parameter of packed experts as `description` says, checked
    against the experts' shapes."""
    if description.get("method") != "gguf_experts" or description.get("num_experts") != module.num_experts:
        raise CacheEntryError("the saved experts' form does not fit the model")
    sizes = {}
    for key, param in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
        rows, cols = module.expert_shapes[param]
        parts = description[key].get("parts", [])
        if sum(p["out_features"] for p in parts) != rows or any(p["in_features"] != cols for p in parts):
            raise CacheEntryError(f"the saved experts' {param} does not fit the model")
        sizes[param] = module.num_experts * sum(p["nbytes"] for p in parts)
    return sizes


def _check(model: nn.Module, tensors: dict[str, torch.Tensor], methods: dict[str, dict], experts: dict[str, dict]) -> None:
    params = dict(model.named_parameters())
    if set(tensors) != set(params):
        raise CacheEntryError(f"tensors differ from the model's: {sorted(set(tensors) ^ set(params))[:5]}")
    layers = _method_params(model)
    for name, description in methods.items():
        if name not in layers or not _expected_form(layers[name], description, tensors[name]):
            raise CacheEntryError(f"{name}: the saved weight's form does not fit the model")
    packed = set()
    for module_name, description in experts.items():
        for param, nbytes in _expert_bytes(model.get_submodule(module_name), description).items():
            saved = tensors[f"{module_name}.{param}"]
            if saved.dtype != torch.uint8 or saved.dim() != 1 or saved.numel() != nbytes:
                raise CacheEntryError(f"{module_name}.{param}: the saved experts' bytes do not fit the model")
            packed.add(f"{module_name}.{param}")
    for name, param in params.items():
        if name in methods or name in packed:
            continue
        saved = tensors[name]
        if saved.shape != param.shape or saved.dtype != param.dtype:
            raise CacheEntryError(
                f"{name}: saved {tuple(saved.shape)} {saved.dtype}, the model has {tuple(param.shape)} {param.dtype}"
            )


def load(model: nn.Module, entry: Path, wait_for_checksum: bool = False) -> Checksum | None:
    """Point `model`'s parameters (and quantized forms) at the memory-mapped weights of `entry`.

    None, with nothing changed, if there is no usable entry (a broken one is discarded).
    Otherwise the checksum of the file, which may still be running: the model must not be used
    before `passed()` says so (with `wait_for_checksum`, it has passed before anything changes).
    """
    if not (entry / MANIFEST_FILE).exists():
        return None
    try:
        tensors, methods, experts, checksum = _read_entry(entry)
        _check(model, tensors, methods, experts)
    except (CacheEntryError, AttributeError, KeyError, TypeError, ValueError) as exc:
        logger.warning("Discarding the cached weights at %s (%s); rebuilding them", entry, exc)
        discard_entry(entry)
        return None
    if wait_for_checksum and not checksum.passed():
        return None
    try:
        os.utime(entry / MANIFEST_FILE)  # in use: not swept as unused
    except OSError:
        pass
    for module_name, description in experts.items():
        module = model.get_submodule(module_name)
        module.install(quant_experts.experts_from_cache(description), tensors[f"{module_name}.gate_up_proj"],
                       tensors[f"{module_name}.down_proj"])
    packed = {f"{m}.{p}" for m in experts for p in ("gate_up_proj", "down_proj")}
    layers = _method_params(model)
    for name, param in model.named_parameters():
        if name in packed:
            continue
        if name in methods:
            quant.install(layers[name], quant.from_cache(methods[name]), tensors[name])
        else:
            param.data = tensors[name]
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return checksum


# --- memory ----------------------------------------------------------------------------------

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)


def cache_file_mappings() -> list[tuple[int, int, int]]:
    """(start, end, resident bytes) of each of this process's mappings of a cached weights file."""
    root = str(weights_root().resolve())
    mappings: list[tuple[int, int, int]] = []
    inside = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                    path = head[5].rstrip("\n") if len(head) == 6 else ""
                    inside = path.startswith(root) and path.endswith(f"/{WEIGHTS_FILE}")
                    if inside:
                        start, end = (int(x, 16) for x in head[0].split("-"))
                        mappings.append((start, end, 0))
                elif inside and head[0] == "Rss:":
                    start, end, _ = mappings[-1]
                    mappings[-1] = (start, end, int(head[1]) * 1024)
    except OSError:
        pass
    return mappings


def _drop_pages(tensor: torch.Tensor, spans: list[tuple[int, int, int]]) -> int:
    """Drop this process's copies of the whole pages inside a tensor that lies in a mapping of
    a cache file (never anonymous memory, whose pages would be lost); later reads page them in
    again from the file. Returns the bytes dropped."""
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(lo <= start and end <= hi for lo, hi, _ in spans):
        return 0
    first, last = -(-start // page) * page, end // page * page
    if last <= first:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) != 0:
        return 0
    return last - first


def release_unread_pages(model: nn.Module) -> int:
    """Hand back to the cache file the float pages of projections that oneDNN has packed: no
    kernel reads them (the packed copy serves every product), so after packing they would only
    double the weights' memory. A table that is also the embedding comes back row by row, as
    tokens are looked up. Only weights mapped from the cache, on a CPU under Linux. Returns the
    bytes released."""
    if not sys.platform.startswith("linux"):
        return 0
    spans = cache_file_mappings()
    released = 0
    layers = {id(m.quant_method): m for m in quant.method_layers(model).values()}  # a tied table once
    for layer in layers.values():
        method = layer.quant_method
        if getattr(method, "packed", None) is not None and layer.weight.device.type == "cpu":
            released += _drop_pages(layer.weight.data, spans)
    return released
