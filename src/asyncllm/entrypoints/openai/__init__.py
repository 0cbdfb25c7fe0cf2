"""The OpenAI-compatible HTTP server (optional extra `server`): `build_app(llm)` is the
ASGI app over an AsyncLLM; `serve(...)` (`asyncllm serve`) runs it on uvicorn."""
