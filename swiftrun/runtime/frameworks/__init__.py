"""Framework integrations: in-place recovery for training loops the script does not own (``swiftrun.hf``).

Each is a thin layer over the step protocol of ``swiftrun.Run`` (runtime/core/recovery.py), imported only by a
script that asks for it, never by ``import swiftrun``.
"""
