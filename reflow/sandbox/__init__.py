"""Tool sandboxes: Docker containers (and a weaker process sandbox) that run model-written code."""
