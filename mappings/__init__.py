"""Mapping tables shipped as package data (TOML files next to this module)."""
