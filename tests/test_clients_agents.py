"""Real agent clients against the real server and the default model: the OpenAI Agents SDK runs a
short loop with one tool over the Responses API (the history resent, as it does by default, and
chained with ``previous_response_id``), each step after the first reporting every full block of
the earlier steps as cached; LangChain's ``ChatOpenAI`` binds tools (chat completions and the
Responses API) and returns pydantic models through ``with_structured_output``.
"""

from __future__ import annotations


import pytest

from server_support import default_model_server

agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

from pydantic import BaseModel, Field  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def srv():
    with default_model_server() as s:
        yield s


def run_agent(srv, previous_response_id: bool):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 12 degrees and sunny in {city}."

    client = AsyncOpenAI(base_url=srv.url + "/v1", api_key="sk-alice-1", max_retries=0)
    agent = Agent(name="weather", instructions="You answer weather questions with the get_weather tool.",
                  tools=[get_weather], model=OpenAIResponsesModel(model=srv.model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=256,
                                                 parallel_tool_calls=False))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4,
                             auto_previous_response_id=previous_response_id)
    return result, calls


@pytest.mark.parametrize("chained", [False, True], ids=["resent_history", "previous_response_id"])
def test_agents_sdk_loop_with_one_tool(srv, chained):
    result, calls = run_agent(srv, chained)
    steps = result.raw_responses
    assert calls and len(steps) >= 2 and isinstance(result.final_output, str)
    bs = srv.state.block_size
    for before, step in zip(steps, steps[1:]):
        u0, u1 = before.usage, step.usage
        want = (u0.input_tokens + u0.output_tokens - 1) // bs * bs  # every full block computed before
        assert u1.input_tokens_details.cached_tokens >= want, (chained, u0, u1)
        # the server continued from the earlier step's stored tokens (resent or chained)
        store = srv.state.responses
        rec = store.get(store.owner_key("alice"), step.response_id)
        how = rec.response["hotprefix"]["continuation"]
        assert how["mode"] == "stored_tokens" and how["from"] == before.response_id, how
        assert rec.response["previous_response_id"] == (before.response_id if chained else None)


class Weather(BaseModel):
    city: str = Field(max_length=20)
    degrees: int = Field(ge=-50, le=60)
    sunny: bool


@pytest.mark.parametrize("responses_api", [False, True], ids=["chat", "responses"])
def test_langchain_bind_tools_and_structured_output(srv, responses_api):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    llm = ChatOpenAI(base_url=srv.url + "/v1", api_key="sk-alice-1", model=srv.model, temperature=0,
                     max_tokens=80, max_retries=0, use_responses_api=responses_api)
    msg = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).invoke(
        "What is the weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"] and isinstance(msg.tool_calls[0]["args"]["city"], str)
    out = llm.with_structured_output(Weather).invoke("Describe the weather in Oslo as JSON.")
    assert isinstance(out, Weather)
