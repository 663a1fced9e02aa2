"""Tools and tool-call history into the prompt, for chat templates with and without tool support.

A chat template that knows tools (it mentions `tools`) gets them through `apply_chat_template(tools=...)`, and
the conversation as Hugging Face defines it: an assistant message's `tool_calls` (arguments as objects), `tool`
messages with their `tool_call_id`. A template that does not would drop all of that (SmolLM2's renders only
`role` and `content`), so for it everything is written as text in the Hermes / Qwen2 format that the tools'
system message asks the model to use and tools.py reads back:
- the tools: described in the system message (`<tools>` JSON, calls in `<tool_call>` tags);
- an assistant's earlier calls: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` after its text;
- tool results: `<tool_response>...</tool_response>` blocks in a user turn, consecutive results in one turn.
"""
from __future__ import annotations

import json

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in template


def tools_system_prompt(tools: list[dict]) -> str:
    """The Hermes / Qwen2 tool instructions, for templates without tool support."""
    described = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{described}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n{TOOL_CALL_OPEN}\n{{\"name\": <function-name>, "
            f"\"arguments\": <args-json-object>}}\n{TOOL_CALL_CLOSE}\n\n"
            f"The results of the calls are given back within {TOOL_RESPONSE_OPEN}{TOOL_RESPONSE_CLOSE} XML tags.")


def with_tools_in_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    prompt = tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{prompt}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def call_text(name: str, arguments) -> str:
    """One call as the model is asked to write it (`arguments`: the object, or text that was not JSON)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"


def result_text(content: str) -> str:
    return f"{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}"


def history_as_text(messages: list[dict]) -> list[dict]:
    """The conversation with its tool calls and results written into plain `role`/`content` messages."""
    out: list[dict] = []
    after_result = False
    for message in messages:
        role = message["role"]
        if role == "tool":
            if after_result:
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n{result_text(message['content'])}"}
            else:
                out.append({"role": "user", "content": result_text(message["content"])})
            after_result = True
            continue
        after_result = False
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            parts = [message["content"]] if message["content"] else []
            parts += [call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append({"role": role, "content": message["content"]})
    return out
