"""The KSI daemon: transport -> router -> services -> providers -> storage."""
