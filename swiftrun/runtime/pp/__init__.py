"""Pipeline recovery: boundary logs, stage checkpoints, replay and parallel replay."""
