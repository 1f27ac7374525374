"""Rendering of command results: rich tables for people (``human``), orjson for machines."""
