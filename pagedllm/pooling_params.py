"""Pooling requests (embeddings), named as in vLLM: `PoolingParams` per request, `PoolerConfig`
per engine (`--pooler-config`), and the `--task`/`--runner`/`--convert` values that ask for them.

A pooling request is a prompt the engine computes without generating: its vector is taken from
the final hidden states (after the model's final norm) of its prompt tokens, pooled one of three
ways (`PoolingType`), then cut to `dimensions` (Matryoshka-style) and L2-normalized when
`normalize`. Plain data only: this module imports nothing from the package but the field checks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedllm.field_types import check_field_types, json_object


class PoolingType(enum.Enum):
    """How a prompt's final hidden states become one vector."""

    LAST = "last"  # the last token's (a causal model's whole prompt has been read by then)
    MEAN = "mean"  # the average over every prompt token
    CLS = "cls"  # the first token's (a BERT-style [CLS] position)

    @classmethod
    def parse(cls, value: "PoolingType | str", field: str) -> "PoolingType":
        """From an enum, or vLLM's names in any case ("LAST", "mean", "CLS")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            name = value.strip().lower()
            for kind in cls:
                if kind.value == name:
                    return kind
            if name in ("all", "step", "none", "rank"):
                raise ValueError(
                    f"{field} {value!r} is not built: it returns a vector per token (or a ranking score); "
                    "give one of LAST, MEAN or CLS."
                )
        raise ValueError(f"{field} must be one of LAST, MEAN or CLS, got {value!r}.")


# vLLM's --task values that mean pooling into embeddings (the rest of its pooling tasks are refused).
EMBED_TASKS = ("embed", "embedding")
# vLLM's pooling tasks not built here: classification, scoring, reward models, per-token vectors.
OTHER_POOLING_TASKS = ("classify", "score", "reward", "token_embed", "token_classify", "encode", "transcription")


@dataclass
class PoolingParams:
    """What one pooling request asks for (vLLM's `PoolingParams`, plus the pooling type).

    `pooling_type` None and `normalize` None take the engine's `PoolerConfig` (by default the
    last token, normalized: vLLM's default for decoder models). `dimensions` keeps the first
    `dimensions` components (a Matryoshka embedding), normalized after the cut when `normalize`.
    `truncate_prompt_tokens` keeps only the prompt's last tokens (-1: the last max_model_len)."""

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: PoolingType | str | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None  # vLLM's; "embed" (the one task served) or None

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or self.dimensions < 1):
            raise ValueError(f"PoolingParams.dimensions must be an integer >= 1, got {self.dimensions!r}.")
        if self.truncate_prompt_tokens is not None and (
            self.truncate_prompt_tokens < -1 or self.truncate_prompt_tokens == 0
        ):
            raise ValueError(
                "PoolingParams.truncate_prompt_tokens must be an integer >= 1 (keep the prompt's last that many "
                f"tokens) or -1 (the last max_model_len), got {self.truncate_prompt_tokens!r}."
            )
        if self.pooling_type is not None:
            self.pooling_type = PoolingType.parse(self.pooling_type, "PoolingParams.pooling_type")
        if self.task is not None and self.task not in EMBED_TASKS:
            raise ValueError(f"PoolingParams.task {self.task!r} is not built: give 'embed' (or None).")

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's tokens after `truncate_prompt_tokens` (its last ones)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return token_ids
        keep = max_model_len if keep == -1 else keep
        return token_ids[-keep:]


_POOLER_KEYS = {"pooling_type", "normalize"}
# vLLM's PoolerConfig keys that change nothing here (prompts are always chunked).
_POOLER_INERT_KEYS = {"enable_chunked_processing"}


@dataclass
class PoolerConfig:
    """The engine's pooling defaults (vLLM's `PoolerConfig`, `--pooler-config` /
    `--override-pooler-config`): the pooling type and normalization of requests that leave them
    out. Default: the last token, L2-normalized, as vLLM's for decoder (causal) models."""

    pooling_type: PoolingType | str = PoolingType.LAST
    normalize: bool = True

    def __post_init__(self) -> None:
        self.pooling_type = PoolingType.parse(self.pooling_type, "pooler_config.pooling_type")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"pooler_config.normalize must be true or false, got {self.normalize!r}.")

    @classmethod
    def parse(cls, value: "PoolerConfig | dict | str | None") -> "PoolerConfig":
        """From vLLM's dict, its JSON text (`--pooler-config '{"pooling_type": "MEAN"}'`), or None
        (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        value = json_object(value, "pooler_config")
        unknown = sorted(set(value) - _POOLER_KEYS - _POOLER_INERT_KEYS)
        if unknown:
            raise ValueError(
                f"pooler_config has key(s) not built here {unknown}; known: {sorted(_POOLER_KEYS)} "
                "(dimensions are asked per request)."
            )
        given = {k: v for k, v in value.items() if k in _POOLER_KEYS and v is not None}
        return cls(**given)


def pooling_asked(flag: str, value: str | None) -> bool:
    """Whether vLLM's `--task`/`--runner`/`--convert` value (or `LLM(task=...)`) asks for
    embeddings; False for generation. A ValueError names a value that is neither."""
    if value is None:
        return False
    generate = {"task": ("auto", "generate"), "runner": ("auto", "generate"), "convert": ("auto", "none")}[flag]
    pooling = {"task": EMBED_TASKS, "runner": ("pooling",), "convert": ("embed",)}[flag]
    if value in generate:
        return False
    if value in pooling:
        return True
    raise ValueError(
        f"--{flag} {value} is not supported here: pagedllm generates text and computes embeddings "
        f"(--{flag} {pooling[0]}); {', '.join(OTHER_POOLING_TASKS[:3])} and other pooling tasks are not built. "
        f"Give --{flag} {generate[1]} or --{flag} {pooling[0]}, or drop --{flag}."
    )
