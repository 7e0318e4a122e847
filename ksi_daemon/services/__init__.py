"""One package per domain (completion, conversations, agents, consortium) plus the small system and monitor services; each registers its handlers when asked to."""
