"""`pagedllm bench serve` against the live server completes every planned request and reports latencies as text and JSON."""

from __future__ import annotations

import json

from pagedllm.cli import main
from tests.server.common import MAX_MODEL_LEN


def test_bench_serve_reports_latencies_and_writes_json(server_url, tmp_path, capsys):
    from pagedllm.bench.datasets import sample_requests
    from pagedllm.bench.serve import MAX_PROMPT_TOKEN_ID

    out = tmp_path / "serve.json"
    code = main(["bench", "serve", "--base-url", server_url, "--num-prompts", "6", "--request-rate", "50",
                 "--output-json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ttft_ms" in printed and "normalized_latency_s_per_token" in printed
    result = json.loads(out.read_text())["results"]
    planned = sample_requests("sharegpt", 6, MAX_MODEL_LEN, MAX_PROMPT_TOKEN_ID, token_range=(100, MAX_PROMPT_TOKEN_ID - 1))
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["output_tokens"] == sum(r.output_len for r in planned)  # ignore_eos: every planned token
    assert 0 < result["ttft_ms"]["median"] <= result["e2e_latency_ms"]["p99"]
    assert result["normalized_latency_s_per_token"] > 0


def test_a_token_text_holding_a_unicode_line_separator_does_not_cut_its_event():
    """JSON leaves U+2028 unescaped inside strings; httpx's aiter_lines splits there."""
    import asyncio

    import httpx

    from pagedllm.bench.serve import send_request

    chunk = {"choices": [{"index": 0, "text": "a\u2028b"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 2}}
    body = "".join(f"data: {json.dumps(c, ensure_ascii=False)}\r\n\r\n" for c in (chunk, chunk, usage)) + "data: [DONE]\n\n"

    async def run():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body.encode()))
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://test/v1/completions", {}, prompt_len=3)

    result = asyncio.run(run())
    assert result.ok, result.error
    assert result.output_len == 2 and len(result.itls) == 1
