"""The default model (SmolLM2-135M-Instruct) behind the server, driven by the official `openai`
client: 20 JSON schemas (nested objects, arrays, enums, required fields, bounded numbers,
patterned strings) through response_format, streamed and not, some with n=3, all at once on a
KV cache small enough that the batch is preempted; every output parses and validates with
`jsonschema`."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from pagedllm.cli import build_parser
from tests.server.common import start_server_thread

pytestmark = pytest.mark.slow

S, I, B = {"type": "string", "maxLength": 12}, {"type": "integer"}, {"type": "boolean"}


def obj(required: bool = True, **properties) -> dict:
    return {"type": "object", "properties": properties, **({"required": list(properties)} if required else {})}


SCHEMAS = [
    obj(name=S, age={"type": "integer", "minimum": 0, "maximum": 120}),
    obj(city=S, population={"type": "integer", "minimum": 1000, "maximum": 99999999}),
    obj(color={"enum": ["red", "green", "blue"]}, hex={"type": "string", "pattern": "^#[0-9a-f]{6}$"}),
    obj(tags={"type": "array", "items": S, "minItems": 1, "maxItems": 3}),
    obj(person=obj(first=S, last=S), active=B),
    obj(price={"type": "number", "minimum": 0, "maximum": 1000}, currency={"enum": ["USD", "EUR"]}),
    obj(code={"type": "string", "pattern": "^[A-Z]{3}$"}, count={"type": "integer", "minimum": 1, "maximum": 9}),
    obj(point=obj(x={"type": "integer", "minimum": -10, "maximum": 10}, y={"type": "integer", "minimum": -10, "maximum": 10})),
    obj(answer={"enum": ["yes", "no"]}, confidence={"type": "number", "minimum": 0, "maximum": 1}),
    obj(title=S, year={"type": "integer", "minimum": 1900, "maximum": 2030}, genre={"enum": ["drama", "comedy", "horror"]}),
    obj(items={"type": "array", "maxItems": 2, "items": obj(name=S, qty={"type": "integer", "minimum": 1, "maximum": 5})}),
    obj(email={"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}),
    obj(scores={"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 2, "maxItems": 4}),
    obj(day={"enum": ["mon", "tue", "wed", "thu", "fri"]}, hour={"type": "integer", "minimum": 0, "maximum": 23}),
    obj(user=obj(id={"type": "integer", "minimum": 1, "maximum": 999}, admin=B), note=S),
    obj(required=False, nickname=S, level={"type": "integer", "minimum": 1, "maximum": 3}),
    obj(lat={"type": "number", "minimum": -90, "maximum": 90}, lon={"type": "number", "minimum": -180, "maximum": 180}),
    obj(version={"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"}, stable=B),
    obj(pet=obj(kind={"enum": ["cat", "dog"]}, legs={"type": "integer", "minimum": 0, "maximum": 4})),
    obj(words={"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3}, done=B),
]
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def server_url():
    # 40 blocks of 16 tokens: the 28 sequences of the batch need about 150 at their longest.
    flags = ["serve", "--port", "0", "--max-model-len", "256", "--num-gpu-blocks", "40", "--swap-space", "0.02",
             "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    server, thread, url = start_server_thread(build_parser().parse_args(flags))
    yield url
    server.should_exit = True
    thread.join(30)


async def _ask(client: openai.AsyncOpenAI, model: str, index: int) -> list[str]:
    schema = SCHEMAS[index]
    stream, n = index % 2 == 0, 3 if index % 5 == 0 else 1
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": f"Give an example JSON object with the keys {list(schema['properties'])}."}],
        response_format={"type": "json_schema", "json_schema": {"name": f"s{index}", "schema": schema, "strict": True}},
        max_tokens=MAX_TOKENS, n=n, temperature=0.7 if n > 1 else 0, seed=index,
    )
    if not stream:
        response = await client.chat.completions.create(**kwargs)
        return [choice.message.content for choice in response.choices]
    texts = [""] * n
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    return texts


def test_twenty_schemas_validate_streamed_and_not_with_n_3_under_preemption(server_url):
    model = httpx.get(server_url + "/v1/models").json()["data"][0]["id"]

    async def run() -> list[list[str]]:
        client = openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(_ask(client, model, i) for i in range(len(SCHEMAS))))

    results = asyncio.run(run())
    for schema, texts in zip(SCHEMAS, results):
        for text in texts:
            jsonschema.validate(json.loads(text), schema)
    assert sum(len(t) for t in results) == 20 + 2 * 4  # n=3 for four schemas
    assert httpx.get(server_url + "/stats").json()["num_preemptions"] > 0
