"""Workers: the KV cache (block engine), the model runner and the step."""
