"""Tool implementations that run inside sandboxes (and, until the sandbox lands, in subprocesses)."""
