"""Providers: the only layer that talks to models; only litellm_provider imports litellm."""
