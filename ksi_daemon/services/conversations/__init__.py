"""Conversations: the in-memory cache of conversation indexes, history rebuilding, and the conversation:* events."""
