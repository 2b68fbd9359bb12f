"""`port fetch`: plan, transfer (through huggingface_hub / modelscope), verify and record downloads.

Modules, one job each: sources (what and where from), globs (the one pattern dialect), paths (refuse unsafe
listings), plan (listing -> what is missing, disk check), hf_backend / ms_backend (the real clients and their
error mapping), verify (hashes), manifest (fetch-manifest.json), progress (rich bars), engine (the order of it all).
The clients are imported lazily, only when a transfer or listing is needed.
"""
