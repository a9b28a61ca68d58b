"""gradkit's private helpers: argument checks, warnings that point at the user's line, the torch internals it reads."""
