"""Test helpers that run as real processes (never used by the services themselves)."""
