"""Shared test helpers (one copy): attention oracles, case builders, backend checks.

Importable from any test file as `from helpers.attention_oracle import ...` (pytest puts tests/
on sys.path, tests/ having no __init__.py).
"""
