"""Data: tokenization of raw text into token files, and the deterministic resumable loader."""
