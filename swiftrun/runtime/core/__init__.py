"""The step transaction, undo, and the generation loop of a recovery."""
