"""Pure tensor code with no Lightning in it (a test enforces it)."""
