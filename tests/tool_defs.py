"""The two tools the chat-tool tests of the engine and of the server share."""

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "maxLength": 24}},
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "clock",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"enum": ["UTC", "Europe/Paris", "Asia/Tokyo"]}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [CALC, CLOCK]
ASK = [{"role": "user", "content": "What is 12 times 7? Use a tool."}]
