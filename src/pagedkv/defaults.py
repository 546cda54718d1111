"""Defaults shared by every entry point, in one torch-free place (the CLI reads them before
anything heavy is imported; the config dataclasses use them as field defaults)."""

BLOCK_SIZE = 16  # tokens per cache block
