"""Model presets built with no hub downloads: the `tiny` CPU default and local HF folders."""
