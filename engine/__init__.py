"""Model execution: the engine protocol the workers drive, and its implementations."""
