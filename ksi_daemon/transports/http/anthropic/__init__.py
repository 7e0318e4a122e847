"""The Anthropic Messages door under /v1: Messages (waited for or streamed), count_tokens and the
model list in Anthropic's shape, translated onto the same events and items as the OpenAI doors.
Its routes are `routes.messages_routes` (imported from there: the HTTP front's token check uses
this package's error shape, so the package itself imports nothing of the front)."""
