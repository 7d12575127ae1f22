"""Logits processing and sampling."""

from pagedllm.sampling.sampler import Sampler, filter_top_k_top_p_min_p, prompt_logprobs

__all__ = ["Sampler", "filter_top_k_top_p_min_p", "prompt_logprobs"]
