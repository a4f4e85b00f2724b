"""Pipeline parallelism: selective logging's planner (logging and replay come later)."""
