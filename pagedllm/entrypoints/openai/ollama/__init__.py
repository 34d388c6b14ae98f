"""Ollama's HTTP API (`/api/*`), as thin translations over the OpenAI server's chat and completion paths.

    protocol.py     Ollama's request and response bodies (pydantic), field names as Ollama's api/types.go
    options.py      Ollama's `options` object -> the sampling fields of the OpenAI requests
    model_info.py   what /api/tags, /api/show and /api/ps say about the served model
    serving.py      /api/chat and /api/generate: one OpenAI request each, its stream read back into
                    Ollama's NDJSON chunks (or one body), with Ollama's nanosecond timings
    routes.py       `add_ollama_routes(app, chat, completions, ...)`; errors as Ollama's {"error": "..."}

Apps that speak only Ollama (n8n's Ollama node, Open WebUI, R's `mall`, the `ollama` Python and JS
clients) reach the same templates, tool parsers, structured outputs and sampling as /v1/chat/completions.
"""
