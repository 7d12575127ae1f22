"""`report.md`: every figure's JSON in the output folder, as one page a reader can check.

A table (figure, what, the paper's number, ours, which clock, target), the figures, the
simulator's validation against the real clock, the profiles' constants, and notes on what
falls short of the paper and why.
"""

from __future__ import annotations

import json
from pathlib import Path

from pagedllm.bench.paper.costs import A100_OPT13B
from pagedllm.bench.paper.profiles import CPU_SCALE

FIGURE_ORDER = ["2", "11", "12", "12 (validation)", "13", "14", "15", "16", "18b", "19"]
COMMANDS = """\
pagedllm bench paper --clock simulated --profile a100-opt13b   # every figure at the paper's scale
pagedllm bench paper --clock simulated --profile cpu           # every figure at this CPU's (calibrated) scale
pagedllm bench paper --clock real --figures 2,12,13            # the default model really run; validates the simulation
"""

# What each figure's numbers mean next to the paper's, and why they differ where they do.
NOTES = {
    "2": "At the paper's scale the four shares land within two points of the paper's for every system. They are "
    "averaged over the steps with requests waiting, when memory is what limits the batch (the paper does not say at "
    "which load it measured). vLLM's remaining slots are the unfilled tails of last blocks and the 1% admission "
    "watermark. On the cpu profile (32 blocks, ShareGPT lengths x1/4, no watermark: 1% of 32 blocks rounds to 0) "
    "vLLM holds 84.5%: the tails of last blocks take 5.5% (3.7 sequences in flight of about 115 tokens, each leaving "
    "7.5 slots of its last block empty on average; 1.7% on the A100), and 10% stays free because the head of the "
    "queue, a preempted sequence on 77% of those steps, needs 5.9 blocks at once while 3.2 are free (1.4% on the "
    "A100). Both shrink only with more and longer sequences in the pool (unscaled lengths, contexts of 2048 and 3072 "
    "slots: 93%), and the CPU cannot batch many within the latency bar (Fig. 12). The real-clock "
    "runs are at 0.7x vLLM's rate, where vLLM's memory is mostly free: they show the engine's own statistic "
    "(`get_stats().kv_breakdown`, `/metrics`), not the paper's saturated picture.",
    "11": "Lengths are log-normal with the paper's means (the datasets are not available offline); truncation to the "
    "2048-token context trims ShareGPT's means by 3%. The cpu profile scales ShareGPT's lengths by 1/4.",
    "12": "a100-opt13b: both ShareGPT ratios land inside the paper's ranges. FasterTransformer falls further behind "
    "than the paper's 22x: here every request of a static batch is answered when its longest sequence ends, and its "
    "decode steps are padded to the whole batch. Alpaca: vLLM/Orca (Oracle) is 1.6x; the paper too reports smaller "
    "gains on Alpaca's short sequences. cpu: a CPU step costs 26.7 ms plus 5.9 ms per decoding sequence (an A100's "
    "step is nearly flat in the batch: it reads the 26 GB of weights once whatever the batch), so twice the unloaded "
    "latency is reached at about 3.4 requests in flight even with unbounded memory (0.83 req/s on ShareGPT), and "
    "batching b requests speeds each token up by at most b x 32.6 / (26.7 + 5.9 b) over one request alone: 2.2x at "
    "b = 3. The 512-slot budget holds vLLM to 70% of that ceiling (memory-bound, as on the A100: 61%), yet its gain "
    "is 1.33x over Orca (Oracle) and 2.44x over Orca (Max). No budget reaches 1.7x over Orca (Oracle): from 512 to "
    "1024 slots the gain stays at 1.16-1.40x. Orca (Max) falls 2.7x behind only at 640-896 slots, where a fifth to a "
    "third of its pool cannot hold a second maximum-length reservation (1024 slots, two reservations: 1.75x). That is the "
    "CPU's cost structure, not the memory manager: the same runs batch more requests with paged memory (Fig. 13), "
    "and the real clock confirms the simulation's step cost (the validation rows).",
    "12 (validation)": "",
    "13": "Read at 1.25x vLLM's sustained rate, where every system's batch is what its memory holds; the baselines' "
    "batches then match the paper's within 0.2 requests. At exactly vLLM's sustained rate its batch is still set by "
    "the load it keeps up with (the ratios in brackets). On the CPU's 32 blocks vLLM holds 2.2x Orca (Oracle)'s token "
    "states but only 1.5x its requests: it preempts (127 times in 174 requests), and each preempted sequence, back at "
    "the head of the queue, waits until about 6 of the 32 blocks are free at once (Fig. 2).",
    "14": "The paper's gain over Orca (Oracle) grows with more samples and beams (1.3x to 2.3x) because sharing lets "
    "vLLM hold more sequences. Ours stays at 1.7-1.9x: in the roofline every sequence reads its whole context, shared "
    "blocks or not, so with several sequences per request vLLM becomes bound by memory bandwidth (about 190 sequences "
    "in flight) before it runs out of memory capacity, and Orca's block copies at HBM speed cost little. Basic "
    "sampling on Alpaca already gives 1.6x here (the paper: 1.3x). In the cpu profile's 32 blocks Orca-Max cannot "
    "hold a request of two or more maximum-length sequences at all, nor Orca (Oracle) the longer requests of 4 or 6.",
    "15": "Savings as the paper defines them (blocks saved by sharing over blocks needed without sharing), averaged over "
    "the steps of a vLLM run at half its sustained rate. Parallel sampling on ShareGPT matches (33% at n=6, just "
    "above the paper's 30.5%); the rest come out higher, more so for wider beams. The beams here draw random log-probabilities, so the surviving beams descend "
    "from few parents and share long prefixes; a real model's beams diverge more. Alpaca's prompts (19 tokens on "
    "average) share at most one full block, so its parallel-sampling savings depend on how the average is weighted.",
    "16": "The paper does not give the translation workload's lengths; we assume 25 tokens in and out per sentence. "
    "5-shot matches (3.5x vs 3.58x); 1-shot comes out higher (2.8x vs 1.67x): Orca (Oracle) reserves 80 + 25 + 25 "
    "tokens rounded up to a power of two of blocks (256 slots), twice its need, and recomputes the prefix for every "
    "request. On the cpu profile a 5-shot request alone takes Orca longer than the latency bar (it recomputes the "
    "341-token prefix on one CPU thread), so no rate is sustained.",
    "18b": "Block size trades the paged kernel's per-block overhead (1 + 4/block size on KV reads, the profile's "
    "constant) against the unfilled tail of each sequence's last block. At the paper's scale ShareGPT is best at 32-64 "
    "(16: +9%, 128: +19%) and Alpaca at 8-32 (16 lowest), close to the paper's 16-128 and 16-32. The cpu profile has no block-size "
    "term (its cost was fitted at block size 16), so there only the memory side shows.",
    "19": "The microbenchmark has the paper's shape: swapping is 13x slower than recomputation at block size 1 (one "
    "copy call per block per layer for keys and values) and within 20% of it from 64 up. End to end, swapping stays 8-13% "
    "behind recomputation from block size 16 on (the paper: comparable at 16-64): with these constants, PCIe moves a "
    "block no faster than the A100 recomputes it. On the cpu profile swapping is a memory copy and always cheaper.",
}


def _load(out_dir: Path) -> list[dict]:
    results = []
    for path in sorted(out_dir.glob("fig*_*.json")):
        try:
            payload = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        result = payload.get("results") or {}
        if "summary" in result:
            result["_path"] = path
            result["_time"] = payload.get("time", "")
            result["_machine"] = payload.get("machine", {})
            results.append(result)
    return results


def _order(result: dict) -> tuple:
    """By figure; for each, the paper's scale first, then this CPU's, then the real clock."""
    figure = result.get("figure", "")
    index = FIGURE_ORDER.index(figure) if figure in FIGURE_ORDER else len(FIGURE_ORDER)
    clock = {"a100-opt13b": 0, "cpu": 1}.get(result.get("profile"), 2) if result.get("clock") != "real" else 3
    return (index, clock)


def _cell(text) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def write_report(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    results = sorted(_load(out_dir), key=_order)
    lines = [
        "# The paper's evaluation, reproduced on pagedllm",
        "",
        "Kwon et al., *Efficient Memory Management for Large Language Model Serving with PagedAttention* "
        "(SOSP 2023), section 6. The baselines are memory policies of this engine's own scheduler "
        "(`kv_policy`): Orca reserves each sequence's KV cache at admission (Oracle: the true length; Pow2: "
        "the next power of two of the output; Max: the context), rounded to a power of two of blocks by a "
        "buddy allocator, never preempting; FasterTransformer runs static batches of as many maximum-length "
        "reservations as fit, until the longest output ends, prompts padded. vLLM is the engine as it is.",
        "",
        "Regenerate (each figure's PNG and JSON land beside this file; this page is rewritten after every run):",
        "",
        "```bash",
        COMMANDS.rstrip(),
        "```",
        "",
        "## Results",
        "",
        "| fig | quantity | paper | ours | clock | target |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        for row in result["summary"]:
            cells = [row["figure"], *(_cell(row[k]) for k in ("quantity", "paper", "ours", "clock", "target"))]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each figure's run time (seconds, on this machine's two shared cores):", ""]
    lines += [f"- Fig. {r['figure']}, {r['where']}: {r.get('seconds', 0):.0f} s" for r in results]
    lines += ["", "(The real clock's runs are made once and shared by figures 2, 12 and 13.)"]

    lines += ["", "## Figures", ""]
    for result in results:
        png = result["_path"].with_suffix(".png")
        if png.exists():
            heading = f"### Fig. {result['figure']}: {result.get('title', '')} ({result['where']})"
            lines += [heading, "", f"![Fig. {result['figure']}]({png.name})", ""]

    lines += _validation(out_dir)
    lines += _profiles(out_dir)

    missed = [(r["figure"], row) for r in results for row in r["summary"] if row["target"] == "missed"]
    if missed:
        lines += ["## Targets missed", ""]
        lines += [f"- Fig. {figure}, {row['clock']}: {row['quantity']}: paper {row['paper']}, ours {row['ours']}" for figure, row in missed]
        lines.append("")
    order = {figure: i for i, figure in enumerate(FIGURE_ORDER)}
    present = sorted({r["figure"].split()[0] for r in results}, key=lambda f: order.get(f, len(order)))
    notes = [f"- **Fig. {figure}.** {NOTES[figure]}" for figure in present if NOTES.get(figure)]
    if notes:
        lines += ["## Discussion: where we match the paper, where we do not, and why", "", *notes, ""]
    machine = next((r["_machine"] for r in results if r.get("_machine")), {})
    if machine:
        flags = " ".join(machine.get("cpu_flags", []))
        lines += ["## Machine", "", f"{machine.get('cpu')}; flags: {flags}; torch {machine.get('torch')}", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _validation(out_dir: Path) -> list[str]:
    """How the simulated clock compares with the real one (`fig12_real.json`)."""
    path = out_dir / "fig12_real.json"
    if not path.exists():
        return []
    payload = json.loads(path.read_text())
    data = payload["results"]["data"]
    curves = [(dataset, system, points) for dataset, d in data.items() for system, points in d["systems"].items()]
    validated = sum(1 for *_, points in curves if min(abs(p["error"]) for p in points) <= 0.15)
    errors = [abs(p["error"]) for *_, points in curves for p in points]
    lines = [
        "## Validation of the simulated clock",
        "",
        f"The default model really served short traces of every curve of Fig. 12 (cpu scale); {validated} of "
        f"{len(curves)} curves agree with their simulation within 15% at one rate at least (mean absolute error over "
        f"all {len(errors)} runs: {100 * sum(errors) / len(errors):.0f}%). Each run is simulated on its own trace with a "
        "step cost fitted to the steps of all the *other* real runs of the session (leave one run out), so the cost is "
        "measured on this machine in the same minutes but never on the run it predicts. A curve whose first rate "
        "misses gets a second one, half the system's own simulated sustained rate; both are shown. The largest misses "
        "are overloaded baselines: once a queue forms, a few percent of step time moves which requests share a step, "
        "and with static batching which requests share a batch. Identical steps measured on this shared two-core "
        "machine vary by +-20% (memory bandwidth taken by other programs), which sets the floor of this comparison.",
        "",
    ]
    slots = payload.get("config", {}).get("scale", {}).get("kv_slots")
    if slots != CPU_SCALE.kv_slots:
        lines += [
            f"These real runs were made at {slots} KV slots; the cpu profile now has {CPU_SCALE.kv_slots}. They validate "
            "the step cost, not this budget's figures: rerun `--clock real`.",
            "",
        ]
    if "sustained_search" not in payload["results"]:
        lines += [
            "Figure 12's target on the real clock (each system's sustained rate, searched with real runs) is not in "
            "these runs: `pagedllm bench paper --clock real --figures 12 --real-search` adds it (about 45 minutes; an hour "
            "for cpu-1b).",
            "",
        ]
    return lines


def _profiles(out_dir: Path) -> list[str]:
    c = A100_OPT13B
    lines = [
        "## Profiles and their constants",
        "",
        "**a100-opt13b** (simulated): OPT-13B on one A100-40GB as in the paper's Table 1: 15,700 KV slots "
        "(26 GB of weights leave 12 GB; 800 KiB per token: 2 x 40 layers x 5120 x 2 bytes), contexts of 2048 tokens, "
        "block size 16, max 256 sequences and 2048 tokens per step, ShareGPT and Alpaca lengths unscaled. "
        "A step costs max(FLOPs / peak, bytes / bandwidth) + overhead:",
        "",
        f"- FLOPs: 2 x {c.num_params:.3g} parameters per token computed; peak {c.peak_flops / 1e12:.0f} TFLOP/s (bf16/fp16 dense)",
        f"- bytes: {c.weight_bytes / 1e9:.0f} GB of weights per step, + {c.kv_bytes_per_token / 1024:.0f} KiB per KV position read "
        f"(x (1 + {c.paged_overhead_tokens:g} / block size) through block tables: 1.25x at block size 16, the paper's 20-26% "
        "kernel overhead; Orca and FasterTransformer read contiguously), + the new tokens' KV, + copied blocks read and written; "
        f"bandwidth {c.memory_bandwidth / 1e12:.2f} TB/s",
        f"- overhead: {c.step_overhead_s * 1e3:.0f} ms per step (scheduling, sampling, launches)",
        f"- swapping a block one way: {2 * c.num_layers} copy calls (keys and values of each layer) of {c.copy_call_s * 1e6:.0f} us "
        f"+ block bytes over PCIe at {c.pcie_bandwidth / 1e9:.0f} GB/s; CPU swap space as large as the device's",
        "",
    ]
    calibration = out_dir / "calibration_cpu.json"  # the default model's (cpu-1b's is calibration_cpu-1b.json)
    if calibration.exists():
        saved = json.loads(calibration.read_text())
        cost, fit, scale = saved["cost"], saved.get("fit", {}), saved["scale"]
        lines += [
            f"**cpu** (simulated and real): the default model on one thread of this CPU ({saved.get('cpu')}), "
            f"{CPU_SCALE.kv_slots} KV slots (one maximum-length sequence), contexts of {CPU_SCALE.max_model_len} tokens, "
            f"block size {CPU_SCALE.block_size}; ShareGPT lengths x1/4, Alpaca's unscaled; traces of 240 s (ShareGPT) "
            "and 120 s (Alpaca). A step costs, fitted by least squares to "
            f"{fit.get('num_steps')} timed steps of the real engine serving calibration traces "
            f"(with {scale['kv_slots']} KV slots, so that batches of 1 to about 20 sequences occur):",
            "",
            f"- {cost['c_step'] * 1e3:.2f} ms + {cost['c_prefill'] * 1e3:.3f} ms per prompt token + {cost['c_decode'] * 1e3:.3f} ms "
            f"per decoding sequence + {cost['c_kv'] * 1e6:.3f} us per KV position read (R^2 {fit.get('r2', 0):.3f}, mean error per step "
            f"{fit.get('mean_abs_error_pct', 0):.1f}%); copies and swaps {cost['c_swap_token'] * 1e6:.2f} us per token one way",
            "- the real clock advances by each step's CPU time on the one thread that runs it (torch held to one thread), so "
            "other programs on this shared machine do not slow it; when nothing runs it jumps to the next arrival",
            "",
        ]
    return lines
