"""The HTTP server: the OpenAI, Anthropic, Responses and Ollama APIs (a module each, registered
with `add_routes(app, routing)`), several models in one pool, the chat page. Imports engine,
loading, text and gguf."""
