// Every decoder layer of a float32 model in one call, for a step of a few tokens whose
// projections are GGUF-packed, of any type with a kernel (a decode step of up to gguf.MAX_ROWS
// sequences): the same kernels the Python layer loop calls, in the same order on the same
// buffers, so the output is bitwise the loop's. What it saves is the loop itself: at a handful
// of sequences, each of the ~300 kernel calls of a step cost more in Python (module calls,
// views, temporaries, ctypes) than in arithmetic.
//
// Per layer, a family's layer as its description (`Layer`) says:
//   norm (with the residual add) -> qkv (+ bias) -> [q/k head norms] -> rotary (whole or partial
//   heads, the layer's own table) -> KV write -> paged attention (the layer's window, scale,
//   soft cap) -> o -> [Gemma: norm of the attention's output] [Granite: x residual_multiplier]
//   -> norm (with the residual add) -> gate_up -> act(gate) * up (SiLU or GELU-tanh) -> down
//   -> [Gemma: norm of the MLP's output] [Granite: x residual_multiplier]
// With `part_ns`, the nanoseconds of each part are added to it (the step profile's parts,
// model/fused_layers.py's PARTS).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "gguf_matmul.h"

extern "C" {
void fused_add_rms_norm_f32(float* out, float* residual, const float* x, const float* weight, int num_rows, int dim,
                            float eps, int num_threads);
void rotary_neox_f32(float* qk, int64_t row_stride, const int64_t* positions, const float* cos_cache,
                     const float* sin_cache, int num_tokens, int num_heads, int head_dim, int rotary_dim,
                     int num_threads);
void silu_and_mul_f32(float* out, const float* x, int num_rows, int dim, int num_threads);
void gelu_tanh_and_mul_f32(float* out, const float* x, int num_rows, int dim, int num_threads);
void write_kv_f32_f32(const void* key, const void* value, void* key_cache, void* value_cache, int64_t block_stride,
                      int64_t head_stride, const int64_t* slot_mapping, int num_tokens, int num_kv_heads,
                      int head_dim, int block_size);
int gguf_dequantize_rows(int qtype_id, float* out, const uint8_t* packed, const int64_t* indices, int64_t num_indices,
                         int64_t num_rows, int64_t in_features, int num_threads);
void paged_attention_f32_f32_windowed(void* out, const void* query, const void* key_cache, const void* value_cache,
                             int64_t block_stride, int64_t head_stride, const int32_t* block_tables,
                             int64_t block_table_stride, const int32_t* item_seq, const int32_t* item_first_token,
                             const int32_t* item_num_tokens, int num_items, const int64_t* token_context,
                             int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                             int fixed_partition_blocks, int sliding_window, float logits_soft_cap, int num_threads);
}

namespace {

// One projection's GGUF-packed weight (`quant.GGUFLinear`: kernels/gguf.py's layout, any
// type) and optional bias. A fused weight whose parts have different types (Q4_K_M's q/k and v)
// has one part each, stacked by output rows.
constexpr int kMaxParts = 3;

struct ProjectionPart {
  const uint8_t* packed;
  int32_t qtype_id;      // gguf.TYPE_IDS
  int32_t out_features;
};

void part_matmul(const ProjectionPart& part, float* y, const float* x, int64_t rows, int64_t in_features,
                 int num_threads, int use_int8) {
  gguf_matmul(part.qtype_id, y, x, part.packed, rows, part.out_features, in_features, num_threads, use_int8);
}

struct Projection {
  ProjectionPart parts[kMaxParts];
  const float* bias;  // null without
  int32_t num_parts;
  int32_t out_features;  // all parts'
  int32_t in_features;
  int32_t int8_rows;  // products of up to this many rows on int8 activations
};

enum Activation { kSilu = 0, kGeluTanh = 1 };

// A sparse mixture of experts (Mixtral, Qwen3-MoE) in place of the dense MLP: a router [E, H],
// each expert's gate-and-up projection (two parts: gate's rows, then up's) and down projection,
// GGUF-packed.
struct MoE {
  const float* router;             // float32 [E, H] (llama.cpp keeps routers in F32), or null ...
  const Projection* router_blocks;  // ... a GGUF-packed router
  const Projection* gate_ups;  // [num_experts]
  const Projection* downs;     // [num_experts]
  int32_t num_experts, top_k, intermediate_size;
  int32_t norm_topk_prob;  // the top k's probabilities rescaled to sum to 1
  int32_t activation;      // Activation
};

// One layer as its family shapes it. Norm weights are as the kernel multiplies (Gemma's 1 + w
// already added); a null norm is a norm the family does not have.
struct Layer {
  const float* input_norm;
  const float* pre_mlp_norm;     // Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm
  const float* attn_out_norm;    // Gemma: post_attention_layernorm, over the attention's output
  const float* mlp_out_norm;     // Gemma: post_feedforward_layernorm, over the MLP's output
  const float* q_norm;           // Qwen3, Gemma 3: an RMSNorm over each query head
  const float* k_norm;           // ... and each key head
  Projection qkv, o, gate_up, down;  // (gate_up and down unused where `moe` is set)
  const MoE* moe;          // null: the dense MLP
  float* key_cache;
  float* value_cache;
  const float* cos_cache;  // the layer's rotary table: [rows, rotary_dim]
  const float* sin_cache;
  int32_t rotary;          // which of the step's table positions index it
  int32_t rotary_dim;      // the dimensions of each head that turn (head_dim but in a partial rotary)
  int32_t kv_group;        // the KV cache group whose block tables and slots address its pools
  int32_t sliding_window;  // keys each token sees (0: its whole context)
  int32_t activation;      // Activation
  float scale;             // of the attention scores
  float logits_soft_cap;   // 0: none (Gemma 2: 50)
  float branch_scale;      // each branch's output times this before its residual add (Granite; else 1)
};

// The step: its tokens, the attention plan (attention/cpu.py's _Plan) and scratch buffers. Slots
// and block tables come per KV cache group (one, for a model whose layers attend alike).
struct Step {
  int32_t num_tokens, hidden_size, num_heads, num_kv_heads, head_dim, block_size, intermediate_size, num_threads;
  float eps;
  float embed_scale;  // the embeddings times this first (Gemma's sqrt(hidden_size); else 1)
  // With input_ids, the step looks its embeddings up itself in the token table: [vocab_size]
  // rows of a GGUF type (embed_type its id) or of float32 (embed_type -1).
  const int64_t* input_ids;
  const void* embed_table;
  int64_t vocab_size;
  int32_t embed_type;
  const int64_t* const* rotary_positions;  // [rotary tables]: each token's row of that table
  const int64_t* const* slot_mappings;  // [groups]
  int64_t block_stride, head_stride;
  const int32_t* const* block_tables;  // [groups]
  const int64_t* block_table_strides;  // [groups]
  const int32_t* item_seq;
  const int32_t* item_first_token;
  const int32_t* item_num_tokens;
  int64_t num_items;
  const int64_t* token_context;
  // scratch: [T, qkv width], [T, heads * head_dim] twice, [T, kv heads * head_dim] twice,
  // [T, hidden], [T, 2 * intermediate], [T, intermediate]
  float *qkv, *query, *attn, *key, *value, *normed, *gate_up, *act;
};

// Parts timed (the order of part_ns).
enum Part { kNorms, kProjections, kRotary, kKvWrite, kAttention, kActivation, kCopies, kEmbedding, kNumParts };

class Timer {
 public:
  explicit Timer(int64_t* part_ns) : part_ns_(part_ns), last_(part_ns ? now() : 0) {}
  void lap(Part part) {
    if (part_ns_ == nullptr) return;
    const int64_t t = now();
    part_ns_[part] += t - last_;
    last_ = t;
  }

 private:
  static int64_t now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  int64_t* part_ns_;
  int64_t last_;
};

void project(float* y, const float* x, const Projection& p, int rows, int num_threads) {
  const int use_int8 = rows <= p.int8_rows;
  if (p.num_parts == 1) {
    part_matmul(p.parts[0], y, x, rows, p.in_features, num_threads, use_int8);
  } else {  // each part into its own rows, then side by side (what torch.cat of the parts' products gives)
    std::vector<float> part_y;
    int64_t column = 0;
    for (int i = 0; i < p.num_parts; ++i) {
      const ProjectionPart& part = p.parts[i];
      part_y.resize(static_cast<size_t>(rows) * part.out_features);
      part_matmul(part, part_y.data(), x, rows, p.in_features, num_threads, use_int8);
      for (int r = 0; r < rows; ++r)
        std::memcpy(y + static_cast<int64_t>(r) * p.out_features + column, part_y.data() + static_cast<int64_t>(r) * part.out_features,
                    sizeof(float) * part.out_features);
      column += part.out_features;
    }
  }
  if (p.bias != nullptr)
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < p.out_features; ++j) y[static_cast<int64_t>(r) * p.out_features + j] += p.bias[j];
}

// Rows of `width` floats at column `offset` of `src` (rows of `stride`) into contiguous `dst`.
void gather_columns(float* dst, const float* src, int rows, int64_t stride, int offset, int width) {
  for (int r = 0; r < rows; ++r)
    std::memcpy(dst + static_cast<int64_t>(r) * width, src + r * stride + offset, sizeof(float) * width);
}

void gated(float* out, const float* x, int rows, int dim, int activation, int threads) {
  if (activation == kGeluTanh)
    gelu_tanh_and_mul_f32(out, x, rows, dim, threads);
  else
    silu_and_mul_f32(out, x, rows, dim, threads);
}

// The router's logits: y [T, E] = x [T, H] W^T, each a float32 dot product in one fixed order.
void router_logits(float* y, const float* x, const float* w, int T, int E, int H, int threads) {
  const int th = static_cast<int64_t>(T) * E * H >= (1 << 18) ? threads : 1;
#pragma omp parallel for collapse(2) schedule(static) num_threads(th)
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) {
      const float* a = x + static_cast<int64_t>(t) * H;
      const float* b = w + static_cast<int64_t>(e) * H;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int h = 0; h < H; ++h) sum += a[h] * b[h];
      y[static_cast<int64_t>(t) * E + e] = sum;
    }
}

// One token's routing: softmax over the E logits, the top k (ties: the lower expert first), their
// probabilities rescaled to sum to 1 where asked, then ordered by expert (ascending).
void route(const float* logits, int E, int k, bool normalize, int32_t* ids, float* weights) {
  float max = logits[0];
  for (int e = 1; e < E; ++e) max = logits[e] > max ? logits[e] : max;
  std::vector<float> probs(E);
  float total = 0.0f;
  for (int e = 0; e < E; ++e) total += probs[e] = std::exp(logits[e] - max);
  for (int e = 0; e < E; ++e) probs[e] /= total;
  std::vector<int32_t> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int32_t a, int32_t b) { return probs[a] > probs[b] || (probs[a] == probs[b] && a < b); });
  float chosen = 0.0f;
  for (int j = 0; j < k; ++j) chosen += probs[order[j]];
  std::sort(order.begin(), order.begin() + k);
  for (int j = 0; j < k; ++j) {
    ids[j] = order[j];
    weights[j] = normalize ? probs[order[j]] / chosen : probs[order[j]];
  }
}

// out [T, H] = sum over each token's k experts (ascending) of weight x expert(x): the pairs
// grouped by expert (in token order within one), each expert's rows in one product.
void moe_forward(float* out, const float* x, const MoE& m, int T, int H, int threads) {
  const int E = m.num_experts, k = m.top_k, I = m.intermediate_size, pairs = T * k;
  std::vector<float> logits(static_cast<size_t>(T) * E), weights(pairs);
  std::vector<int32_t> ids(pairs);
  if (m.router != nullptr)
    router_logits(logits.data(), x, m.router, T, E, H, threads);
  else
    project(logits.data(), x, *m.router_blocks, T, threads);
  for (int t = 0; t < T; ++t)
    route(logits.data() + static_cast<int64_t>(t) * E, E, k, m.norm_topk_prob != 0, ids.data() + t * k,
          weights.data() + t * k);
  std::vector<int32_t> order(pairs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  // Each expert's run of pairs [begin, end) in `order`; its rows, products and outputs live at the
  // same offsets of the buffers, so experts never share memory.
  std::vector<int> runs;
  for (int p = 0; p < pairs; ++p)
    if (p == 0 || ids[order[p]] != ids[order[p - 1]]) runs.push_back(p);
  const int num_runs = static_cast<int>(runs.size());
  runs.push_back(pairs);
  std::vector<float> rows(static_cast<size_t>(pairs) * H), gate_up(static_cast<size_t>(pairs) * 2 * I),
      act(static_cast<size_t>(pairs) * I), per_pair(static_cast<size_t>(pairs) * H);
  const auto expert = [&](int r, int expert_threads) {
    const int begin = runs[r], count = runs[r + 1] - begin, e = ids[order[begin]];
    float* xr = rows.data() + static_cast<int64_t>(begin) * H;
    float* gu = gate_up.data() + static_cast<int64_t>(begin) * 2 * I;
    float* a = act.data() + static_cast<int64_t>(begin) * I;
    float* y = per_pair.data() + static_cast<int64_t>(begin) * H;  // (rows in `order`)
    for (int i = 0; i < count; ++i)
      std::memcpy(xr + static_cast<int64_t>(i) * H, x + static_cast<int64_t>(order[begin + i] / k) * H, sizeof(float) * H);
    project(gu, xr, m.gate_ups[e], count, expert_threads);
    gated(a, gu, count, I, m.activation, expert_threads);
    project(y, a, m.downs[e], count, expert_threads);
  };
  // A decode step's experts each take a row or two: a thread per expert (each product whole, so
  // every output is the one the product computes on any number of threads); else each expert's
  // product spread over the threads.
  if (num_runs >= 2 * threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int r = 0; r < num_runs; ++r) expert(r, 1);
  } else {
    for (int r = 0; r < num_runs; ++r) expert(r, threads);
  }
  std::vector<int32_t> place(pairs);  // pair -> its row in `order` (and in per_pair)
  for (int p = 0; p < pairs; ++p) place[order[p]] = p;
  // each pair's output times its weight, then summed over the token's experts in ascending order
  const auto row = [&](int pair) { return per_pair.data() + static_cast<int64_t>(place[pair]) * H; };
  for (int t = 0; t < T; ++t) {
    float* o = out + static_cast<int64_t>(t) * H;
    const float* y0 = row(t * k);
    const float w0 = weights[t * k];
    for (int h = 0; h < H; ++h) o[h] = y0[h] * w0;
    for (int j = 1; j < k; ++j) {
      const float* yj = row(t * k + j);
      const float wj = weights[t * k + j];
      for (int h = 0; h < H; ++h) {
        const float weighted = yj[h] * wj;
        o[h] = o[h] + weighted;
      }
    }
  }
}

// x *= scale, over n floats (a Granite branch; a float product, as torch's).
void scale_in_place(float* x, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

// The step's embeddings into hidden [T, H] from the token table (Step::input_ids); false if an id
// is outside the vocabulary (nothing then is computed).
bool look_up_embeddings(const Step* s, float* hidden) {
  const int T = s->num_tokens, H = s->hidden_size;
  if (s->embed_type >= 0)
    return gguf_dequantize_rows(s->embed_type, hidden, static_cast<const uint8_t*>(s->embed_table), s->input_ids, T,
                                s->vocab_size, H, s->num_threads) == 0;
  for (int t = 0; t < T; ++t)
    if (s->input_ids[t] < 0 || s->input_ids[t] >= s->vocab_size) return false;
  const float* table = static_cast<const float*>(s->embed_table);
  for (int t = 0; t < T; ++t)
    std::memcpy(hidden + static_cast<int64_t>(t) * H, table + s->input_ids[t] * H, sizeof(float) * H);
  return true;
}

}  // namespace

extern "C" {

// hidden: [T, hidden_size], the embeddings in (unless the step looks them up itself:
// Step::input_ids); the last layer's output (not yet added to the residual stream) out.
// residual: [T, hidden_size], the residual stream out. With final_norm (the model's final norm's
// weight, as the kernel multiplies), out: [T, hidden_size], the final norm of the two (what the
// model's norm module computes after the layers), so the step's hidden states leave the call
// ready for the head. part_ns: null, or kNumParts counters. Returns -1 (and
// computes nothing) if an input id is outside the vocabulary, else 0.
int decoder_layers_f32(const Layer* layers, int num_layers, const Step* s, float* hidden, float* residual,
                       const float* final_norm, float* out, int64_t* part_ns) {
  const int T = s->num_tokens, H = s->hidden_size, threads = s->num_threads;
  const int q_width = s->num_heads * s->head_dim, kv_width = s->num_kv_heads * s->head_dim;
  const int64_t qkv_width = q_width + 2 * kv_width;
  Timer timer(part_ns);
  if (s->input_ids != nullptr && !look_up_embeddings(s, hidden)) return -1;
  if (s->embed_scale != 1.0f) scale_in_place(hidden, static_cast<int64_t>(T) * H, s->embed_scale);
  timer.lap(kEmbedding);
  std::memcpy(residual, hidden, sizeof(float) * T * H);
  timer.lap(kCopies);
  for (int l = 0; l < num_layers; ++l) {
    const Layer& layer = layers[l];
    if (l == 0)  // the first layer's residual is its input: norm it alone
      fused_add_rms_norm_f32(s->normed, nullptr, hidden, layer.input_norm, T, H, s->eps, threads);
    else
      fused_add_rms_norm_f32(s->normed, residual, hidden, layer.input_norm, T, H, s->eps, threads);
    timer.lap(kNorms);
    project(s->qkv, s->normed, layer.qkv, T, threads);
    timer.lap(kProjections);
    gather_columns(s->query, s->qkv, T, qkv_width, 0, q_width);
    gather_columns(s->key, s->qkv, T, qkv_width, q_width, kv_width);
    gather_columns(s->value, s->qkv, T, qkv_width, q_width + kv_width, kv_width);
    timer.lap(kCopies);
    if (layer.q_norm != nullptr) {  // each head a row (in place: the kernel reads a row before writing it)
      fused_add_rms_norm_f32(s->query, nullptr, s->query, layer.q_norm, T * s->num_heads, s->head_dim, s->eps, threads);
      fused_add_rms_norm_f32(s->key, nullptr, s->key, layer.k_norm, T * s->num_kv_heads, s->head_dim, s->eps, threads);
      timer.lap(kNorms);
    }
    const int64_t* positions = s->rotary_positions[layer.rotary];
    rotary_neox_f32(s->query, q_width, positions, layer.cos_cache, layer.sin_cache, T, s->num_heads, s->head_dim,
                    layer.rotary_dim, threads);
    rotary_neox_f32(s->key, kv_width, positions, layer.cos_cache, layer.sin_cache, T, s->num_kv_heads, s->head_dim,
                    layer.rotary_dim, threads);
    timer.lap(kRotary);
    write_kv_f32_f32(s->key, s->value, layer.key_cache, layer.value_cache, s->block_stride, s->head_stride,
                     s->slot_mappings[layer.kv_group], T, s->num_kv_heads, s->head_dim, s->block_size);
    timer.lap(kKvWrite);
    paged_attention_f32_f32_windowed(s->attn, s->query, layer.key_cache, layer.value_cache, s->block_stride,
                                     s->head_stride, s->block_tables[layer.kv_group],
                                     s->block_table_strides[layer.kv_group], s->item_seq, s->item_first_token,
                                     s->item_num_tokens, static_cast<int>(s->num_items), s->token_context,
                                     s->num_heads, s->num_kv_heads, s->head_dim, s->block_size, layer.scale, 0,
                                     layer.sliding_window, layer.logits_soft_cap, threads);
    timer.lap(kAttention);
    project(hidden, s->attn, layer.o, T, threads);
    timer.lap(kProjections);
    if (layer.attn_out_norm != nullptr)
      fused_add_rms_norm_f32(hidden, nullptr, hidden, layer.attn_out_norm, T, H, s->eps, threads);
    if (layer.branch_scale != 1.0f) scale_in_place(hidden, static_cast<int64_t>(T) * H, layer.branch_scale);
    fused_add_rms_norm_f32(s->normed, residual, hidden, layer.pre_mlp_norm, T, H, s->eps, threads);
    timer.lap(kNorms);
    if (layer.moe != nullptr) {
      moe_forward(hidden, s->normed, *layer.moe, T, H, threads);
      timer.lap(kProjections);
    } else {
      project(s->gate_up, s->normed, layer.gate_up, T, threads);
      timer.lap(kProjections);
      gated(s->act, s->gate_up, T, s->intermediate_size, layer.activation, threads);
      timer.lap(kActivation);
      project(hidden, s->act, layer.down, T, threads);
      timer.lap(kProjections);
    }
    if (layer.mlp_out_norm != nullptr) {
      fused_add_rms_norm_f32(hidden, nullptr, hidden, layer.mlp_out_norm, T, H, s->eps, threads);
      timer.lap(kNorms);
    }
    if (layer.branch_scale != 1.0f) scale_in_place(hidden, static_cast<int64_t>(T) * H, layer.branch_scale);
  }
  if (final_norm != nullptr) {
    fused_add_rms_norm_f32(out, residual, hidden, final_norm, T, H, s->eps, threads);
    timer.lap(kNorms);
  }
  return 0;
}

int decoder_layers_num_parts() { return kNumParts; }

// A mixture-of-experts MLP alone (the Python layer loop's, `model.moe.SparseMoE` on a float32 CPU
// with GGUF-packed experts): the very code the fused step runs. out, x: [T, H].
void moe_layer_f32(float* out, const float* x, const MoE* moe, int num_tokens, int hidden_size, int num_threads) {
  moe_forward(out, x, *moe, num_tokens, hidden_size, num_threads);
}

}  // extern "C"
