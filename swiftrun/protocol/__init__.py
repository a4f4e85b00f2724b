"""What crosses a process boundary, imported by the launcher and the runtime alike (torch-free)."""
