"""How a layer's weight is stored and multiplied: one method object per form (vLLM's
`quant_method`), so the layers, the weight cache, the fused decoder and batch-invariant mode
ask the method instead of branching on types.

- `base.py`: the interface (`LinearMethod`), `install` (a method over its storage) and the
  lookups every pass shares (`method_layers`, `layer_of`, `dense_weight`, `logical_shape`).
- `float.py`: `FloatLinear`, a float tensor in the model's dtype; products through oneDNN's
  packed copy on a CPU, else `F.linear`; `use_float` turns any method into it
  (batch-invariant mode).
- `half.py`: `HalfLinear`, an F16 or BF16 GGUF weight kept 16-bit in a float32 model.
- `gguf.py`: `GGUFLinear`, the GGUF blocks as the kernels read them (about the file's bytes, no
  float copy), int8 activations up to `int8_rows` rows.
- `experts.py`: a mixture's experts (`moe.Experts`): `FloatExperts`, `GGUFExperts` (a
  `GGUFLinear` per expert over views of two flat parameters). They are not among
  `method_layers`, so the dense passes (oneDNN packing, int8 activations, the fused decoder,
  batch-invariant mode) leave them alone.
- `selection.py`: the choice when a weight arrives (`load_part`: GGUF blocks where every part
  of the weight has a kernel and the model computes in float32 on a CPU, 16-bit kept where
  every part is 16-bit, else float in the model's dtype) or comes back from the weight cache
  (`from_cache`).
- `int8_trial.py`: where int8 activations pay, measured once per machine and kept.

A method's properties: `batch_invariant` (a row's product is the same whatever rows share it),
`dense` (a float [out, in] tensor in `layer.weight`), `int8_rows`, `fused_parts` (what the C++
decoder loop reads, model/fused_layers.py), `cache_description` (how the weight cache rebuilds
it), `bind` (its views of the storage, once installed), `logical_shape`.

Paths that dequantize at load (a float copy, no GGUF blocks): bfloat16/float16 models, GPUs,
tensor-parallel shards whose columns do not fall on block boundaries, stacked MoE experts whose
three stacks are not all of native types, and batch-invariant mode (`use_float`).
"""

from pagedllm.model.quant.base import LinearMethod, dense_weight, install, layer_of, logical_shape, method_layers
from pagedllm.model.quant.float import FloatLinear, use_float
from pagedllm.model.quant.gguf import EVERY_SIZE, GGUFLinear
from pagedllm.model.quant.half import HalfLinear
from pagedllm.model.quant.selection import from_cache, load_part

__all__ = [
    "EVERY_SIZE", "FloatLinear", "GGUFLinear", "HalfLinear", "LinearMethod", "dense_weight", "from_cache", "install",
    "layer_of", "load_part", "logical_shape", "method_layers", "use_float",
]
