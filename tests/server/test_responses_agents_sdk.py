"""OpenAI's Agents SDK (`openai-agents`) runs an agent with a function tool against the tiny
random model's server through `/v1/responses` (`OpenAIResponsesModel`), non-streamed and
streamed. The tiny model would not choose the tool by itself, so `ModelSettings.tool_choice`
forces it (its argument an enum, so the call is short); and as the model never ends a text
answer within a few tokens (the SDK refuses an incomplete response, as it should), the agent
stops at its tool's output (`tool_use_behavior="stop_on_first_tool"`). The oracle is the SDK's
own run: it parsed the function call, ran the tool with the arguments its schema asks for, and
finished with the tool's output."""

from __future__ import annotations

import asyncio
from typing import Literal

import openai
import pytest

from tests.server.common import MODEL

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def server(long_context_url):
    return long_context_url


def _agent(server: str, calls: list[str]):
    agents.set_tracing_disabled(True)  # no trace export to OpenAI's servers

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"18 degrees and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    return agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(MODEL, client),
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=40),
        tool_use_behavior="stop_on_first_tool",
    )


def _tool_outputs(result) -> list[str]:
    return [item.output for item in result.new_items if item.type == "tool_call_output_item"]


def test_an_agent_runs_its_forced_function_tool_and_finishes(server):
    calls: list[str] = []
    result = asyncio.run(agents.Runner.run(_agent(server, calls), "What is the weather in Paris?", max_turns=4))
    assert len(calls) == 1 and calls[0] in ("Paris", "Oslo")  # the schema's enum, as the SDK parsed it
    assert _tool_outputs(result) == [f"18 degrees and sunny in {calls[0]}"]
    assert result.final_output == f"18 degrees and sunny in {calls[0]}"
    assert len(result.raw_responses) == 1


def test_a_streamed_agent_run_runs_its_tool_and_finishes(server):
    calls: list[str] = []

    async def run():
        result = agents.Runner.run_streamed(_agent(server, calls), "What is the weather in Oslo?", max_turns=4)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert len(calls) == 1 and "raw_response_event" in kinds
    assert _tool_outputs(result) == [f"18 degrees and sunny in {calls[0]}"]
    assert result.is_complete and result.final_output == f"18 degrees and sunny in {calls[0]}"
