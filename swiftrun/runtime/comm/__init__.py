"""Process groups, their abort, and the interception of the script's collectives and DDP."""
