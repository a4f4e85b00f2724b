"""Data-parallel recovery: consensus on the iteration, DDP's broadcast buffers."""
