"""What the choice of how many proposed tokens to verify can give, with pagedllm's n-gram proposals,
on the prompts of `pagedllm bench spec`: an offline replay of the plain greedy outputs.

The default model decodes each prompt once, greedily, without speculation. The replay then walks
each output as a speculative engine would: at each step the real `NgramProposer` proposes from
the tokens so far, a policy chooses k, the proposal's tokens are accepted as far as they equal the
output's, and the step costs `--step-ms` + `--token-ms` per verified token (measured in engine
steps of the default model on the 2-core AVX-512 machine: 8.4 ms and 1.15 ms). Policies:
- `match-length`: the engine's `SpecController`, with each proposal's match length;
- `per-sequence`: the same controller without match lengths (one geometric rate per sequence,
  as before 2026-12-04);
- `foresight`: knows how much of each proposal will be accepted and verifies exactly that, when
  it pays: no choice of k can do better with these proposals.
Each set's speed-up is its plain time over its replayed time (plus `--prompt-ms` per request on
both sides). No timing of the model is involved: the figures are the same on any machine.

A second table gives, per match-length bucket (`spec_controller.MATCH_BUCKETS`), how often the
first token of a proposal made at every position of the outputs is right, and how far a proposal
whose first token is right runs on: what the controller's priors were set from.

    python benchmarks/spec_replay.py --max-tokens 128 --output-json results/spec_replay.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedllm.bench.report import format_table, write_json  # noqa: E402
from pagedllm.bench.spec import chat_prompts, grounded_prompts  # noqa: E402
from pagedllm.core import Sequence  # noqa: E402
from pagedllm.engine.spec_controller import MATCH_BUCKETS, SpecController, match_bucket  # noqa: E402
from pagedllm.engine.spec_decode import NgramProposer  # noqa: E402


def accepted(proposal: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(proposal) and n < len(truth) and proposal[n] == truth[n]:
        n += 1
    return n


def replay(policy: str, prompt: list[int], output: list[int], args, controller: SpecController) -> float:
    """Milliseconds of the speculative decode of `output` (its first token comes from the prompt step)."""
    proposer = NgramProposer(args.lookup_max, args.lookup_min)
    step_ms = lambda tokens: args.step_ms + args.token_ms * (tokens - 1)  # noqa: E731
    done, total = 1, 0.0
    while done < len(output):
        seq = Sequence(0, prompt + output[:done])
        room = min(args.k, len(output) - done - 1)
        proposal = proposer.propose(seq, room) if room > 0 else []
        match = proposer.match_lengths.get(0) if policy == "match-length" else None
        truth = output[done:]
        if not proposal:
            k = 0
        elif policy == "foresight":
            right = accepted(proposal, truth)
            k = right if right and (right + 1) / step_ms(1 + right) > 1 / step_ms(1) else 0
        else:
            k = controller.choose({0: proposal}, 1, 1, False, 10_000, {0: match} if match is not None else None)[0]
        right = accepted(proposal[:k], truth)
        controller.observe_step(1 + k, k > 0, step_ms(1 + k) / 1000)
        if proposal:
            controller.observe_tokens(0, proposal, truth[: right + 1], match)
        done += right + 1
        total += step_ms(1 + k)
    return total


def by_match(traces: dict, args) -> list[dict]:
    """Per match-length bucket: proposals made at every position of every output, the share
    whose first token is right, and the mean accepted length of those."""
    counts: dict[int, list[int]] = {}
    for runs in traces.values():
        for prompt, output in runs:
            proposer = NgramProposer(args.lookup_max, args.lookup_min)
            for done in range(1, len(output) - 1):
                proposal = proposer.propose(Sequence(0, prompt + output[:done]), args.k)
                if proposal:
                    right = accepted(proposal, output[done:])
                    entry = counts.setdefault(match_bucket(proposer.match_lengths[0]), [0, 0, 0])
                    entry[0] += 1
                    entry[1] += right > 0
                    entry[2] += right
    bounds = (*MATCH_BUCKETS, None)
    return [{"match_length": f"<= {bounds[b]}" if bounds[b] else f"> {MATCH_BUCKETS[-1]}", "proposals": n,
             "first_right": round(first / n, 2), "run_when_right": round(total / max(first, 1), 1)}
            for b, (n, first, total) in sorted(counts.items())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=16, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=8.4)
    parser.add_argument("--token-ms", type=float, default=1.15)
    parser.add_argument("--prompt-ms", type=float, default=60.0)
    parser.add_argument("--output-json", default="results/spec_replay.json")
    args = parser.parse_args()

    from pagedllm import LLM, SamplingParams

    llm = LLM()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    traces = {}
    for set_name, prompts in (("grounded", grounded_prompts()), ("chat", chat_prompts())):
        for name, message in prompts:
            out = llm.chat([{"role": "user", "content": message}], params, use_tqdm=False)[0]
            traces.setdefault(set_name, []).append((list(out.prompt_token_ids), list(out.outputs[0].token_ids)))
    rows = []
    for set_name, runs in traces.items():
        plain = sum(args.prompt_ms + args.step_ms * (len(o) - 1) for _, o in runs)
        row = {"set": set_name, "prompts": len(runs), "output_tokens": sum(len(o) for _, o in runs)}
        for policy in ("per-sequence", "match-length", "foresight"):
            controller = SpecController()  # one engine's controller, across the set's requests
            spec = sum(args.prompt_ms + replay(policy, p, o, args, controller) for p, o in runs)
            row[policy] = round(plain / spec, 3)
        rows.append(row)
    print(format_table(rows))
    buckets = by_match(traces, args)
    print()
    print(format_table(buckets))
    print(f"replayed speed-ups (plain time / speculative time); step {args.step_ms} ms + {args.token_ms} ms a "
          f"verified token, {args.prompt_ms} ms a prompt; k {args.k}, lookup {args.lookup_max}/{args.lookup_min}")
    path = write_json(args.output_json, "spec_replay", vars(args), {"sets": rows, "by_match": buckets})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
