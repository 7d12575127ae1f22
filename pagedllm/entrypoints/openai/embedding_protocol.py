"""Request bodies of `POST /v1/embeddings` (OpenAI's, with vLLM's extra fields) and vLLM's
`POST /pooling`; the responses are plain dicts built by `serving_embedding`.

OpenAI's fields: `input` (a string, a list of strings, a list of token ids or a list of such
lists), `model`, `encoding_format` ("float" or "base64": little-endian float32), `dimensions`,
`user`. vLLM's: `truncate_prompt_tokens` (keep each input's last tokens; -1: the last
max_model_len), `normalize`, `add_special_tokens`, and chat `messages` in place of `input`
(through the model's chat template).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from pagedllm.entrypoints.openai.protocol import ChatMessage, NonEmptyText, OpenAIBaseModel, TokenIds

# Empty inputs are outside the schema (a 400 naming `input`), as empty prompts are.
EmbeddingInput = (
    NonEmptyText
    | TokenIds
    | Annotated[list[NonEmptyText], Field(min_length=1)]
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class EmbeddingRequest(OpenAIBaseModel):
    """`POST /v1/embeddings`: one vector per input, in input order."""

    model: str | None = None
    input: EmbeddingInput | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extra fields
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    normalize: bool | None = None  # None: the server's --pooler-config (true by default)
    add_special_tokens: bool = True
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)  # instead of input
    add_generation_prompt: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class PoolingRequest(EmbeddingRequest):
    """vLLM's `POST /pooling`: the same inputs and vector; `task` "embed" (the one served here)."""

    task: str | None = None
