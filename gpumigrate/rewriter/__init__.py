"""The engine: files in, findings, diffs and writes out. Knows no torch API."""
