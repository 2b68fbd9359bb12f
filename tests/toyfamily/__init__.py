"""A toy model family that lives outside the package: a table, generated-style shape data and a small module."""
