"""A script the launcher takes for one that registers (it imports swiftrun), so the agent starts its zygote
and a warm spare; the workers themselves only sleep (no torch)."""

import time

import swiftrun  # noqa: F401

time.sleep(300)
