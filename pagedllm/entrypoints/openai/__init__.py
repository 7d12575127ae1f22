"""The OpenAI-compatible HTTP server (`pagedllm serve`): FastAPI routes over an `AsyncLLMEngine`."""
