"""Sharded data-parallel recovery (FSDP2 with replica groups, HSDP): each shard copied from its replica."""
