"""The worker's plumbing: its environment, its link to the agent, process helpers, injected faults."""
