"""When the engine dies, /health answers 503 with the cause and requests fail cleanly with service_unavailable."""

from __future__ import annotations

from tests.server.common import MAX_MODEL_LEN, MODEL, wait_until


def test_a_dead_engine_makes_health_503_and_requests_fail_cleanly(tiny_llama):
    from fastapi.testclient import TestClient

    from pagedllm import EngineArgs
    from pagedllm.engine.async_llm_engine import AsyncLLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama), max_model_len=MAX_MODEL_LEN, num_gpu_blocks=32))
    engine.IDLE_POLL_S = 0.05

    def gone():
        raise RuntimeError("worker 1 exited")

    engine.engine.executor.check_health = gone
    with TestClient(build_app(engine, [MODEL], log_stats=False)) as http:
        wait_until(lambda: http.get("/health").status_code == 503, timeout=30)
        assert "worker 1 exited" in http.get("/health").json()["error"]["message"]
        response = http.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
