"""Model directories: the tiny locally built model for tests and the demo."""
