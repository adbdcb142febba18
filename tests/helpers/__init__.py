"""Helpers of the reliability tests (bad input, interruptions, untrusted files, determinism)."""
