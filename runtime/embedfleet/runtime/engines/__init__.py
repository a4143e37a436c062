"""Inference engines. Each file is one engine behind the `Engine` interface in base.py."""
