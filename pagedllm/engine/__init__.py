"""The request lifecycle above the scheduler: the engine, output processing and stats."""
