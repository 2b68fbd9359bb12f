"""`port batch`: many ports from one jobs file, each step one call of an existing verb, resumable, on a local
process pool or on a Ray cluster (docs/batch.md)."""
