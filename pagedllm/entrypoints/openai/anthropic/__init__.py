"""Anthropic's Messages API (what Claude Code and the `anthropic` SDKs speak), over the chat path.

protocol.py    request / response bodies, the error body, the stop-reason mapping
serving.py     a Messages request as a chat request, a chat response as a Message; count_tokens
streaming.py   the chat stream as Anthropic's server-sent events
routes.py      POST /v1/messages, POST /v1/messages/count_tokens (add_anthropic_routes)
"""
