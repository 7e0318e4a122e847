"""Agents: profiles, spawned agents, their messages and the events their replies may emit."""
