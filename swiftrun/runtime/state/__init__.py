"""The training state: registry, tensor trees, transfer between ranks, digests and verification."""
