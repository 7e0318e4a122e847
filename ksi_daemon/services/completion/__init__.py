"""Completion: requests, their queue and scheduling, history preparation inputs, provider calls and exchange records."""
