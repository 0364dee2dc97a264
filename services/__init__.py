"""Omni-Flow services: one sub-package per service."""
